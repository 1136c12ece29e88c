/*
 * crc32c.h -- CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by every
 * checksum in the segment format (docs/format/segment.md, "Checksums").
 *
 * Streaming form: crc = sl_crc32c(0, a, n); crc = sl_crc32c(crc, b, m) equals the CRC of a||b.
 * The initial and final inversions are applied inside, so sl_crc32c(0, "123456789", 9)
 * is the standard check value 0xE3069283.
 */
#ifndef MWPSTORE_CRC32C_H
#define MWPSTORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

uint32_t sl_crc32c(uint32_t crc, const uint8_t *data, size_t length);
uint32_t sl_crc32c_portable(uint32_t crc, const uint8_t *data, size_t length);
/* 1 when sl_crc32c uses the SSE4.2 crc32 instruction on this CPU, else 0. */
int sl_crc32c_hardware(void);

#endif
