"""Signed snapshots of 100k aggregates (DESIGN §8: create + sign, and verify, each within 2× of
plainly encoding and blake3-hashing the same state; issue 5: each < 1 s).

Reproduce the committed results (``bench/results/snapshot.json``) with::

    python bench/bench_snapshot.py --rounds 15   # 100k aggregates (the committed run)
    python bench/bench_snapshot.py               # 100k aggregates, 7 rounds
    python bench/bench_snapshot.py --quick       # 20k aggregates, 3 rounds

Subjects, all on the same in-memory state (built once, not timed; no disk is touched):

- ``mwpstore``: ``create_snapshot`` (check, sort, canonical msgpack with sorted keys, blake3, header,
  Ed25519 signature, file bytes) or ``verify_snapshot`` (every check of docs/format/snapshot.md,
  including decoding the state back into ``Effect``s);
- ``mwpstore`` in ``snapshot_create_from_index_bytes``: the same snapshot (identical bytes) made
  from rows whose state is ``msgspec.Raw`` canonical msgpack, as an index storing states with sorted
  keys would hand them over;
- ``plain``: ``msgspec.msgpack.encode`` of the same list of aggregates + ``blake3`` of the bytes —
  the DESIGN §8 baseline for both rows;
- ``plain_decode`` (verify row only): ``blake3`` + ``msgspec.msgpack.decode`` of the same bytes into
  the same types, i.e. the least work any verifier that returns the aggregates must do, with the
  same garbage-collector handling as ``verify_snapshot`` (paused during the decode; the one
  young-generation collection the new objects cost afterwards is timed for both).

The aggregates look like the work model's: 100k WorkItem-like dicts of ten fields (~170 bytes each
encoded, ~17 MB in all), handed over in key order as an index scan would. Values are seconds per
snapshot (lower is better); ratios are mwpstore ÷ subject on medians.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blake3  # noqa: E402
import msgspec  # noqa: E402
from harness import Bench, RoundContext, Target, argument_parser, progress, selected  # noqa: E402

from mwpstore.messages import Effect  # noqa: E402
from mwpstore.snapshot import Keyring, SigningKey, create_snapshot, verify_snapshot  # noqa: E402

HEAD_HASH = bytes(range(32))


def workitem_state(index: int) -> dict:
    return {
        "mission": f"mission-{index % 100}",
        "state": ("queued", "leased", "submitted")[index % 3],
        "attempt": index % 3,
        "ownership_epoch": index % 5,
        "priority": index % 10,
        "cost_spent": index * 7,
        "not_before_ms": 1_700_000_000_000 + index,
        "lease": None,
        "publications": [],
        "title": f"work item {index}",
    }


def build_aggregates(count: int) -> list[Effect]:
    return [Effect(f"workitem:wi-{index:07d}", 1 + index % 4, workitem_state(index)) for index in range(count)]


def main() -> None:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--aggregates", type=int, default=None, help="aggregates per snapshot (default 100k, quick 20k)")
    args = parser.parse_args()
    count = args.aggregates or (20_000 if args.quick else 100_000)
    bench = Bench("snapshot", quick=args.quick, rounds=args.rounds or (3 if args.quick else 7))
    progress(f"building {count} aggregates")
    aggregates = build_aggregates(count)
    signer = SigningKey.generate()
    keyring = Keyring([signer.public_key])
    snapshot = create_snapshot(
        org="acme", group="g-bench", seq=count, head_hash=HEAD_HASH, aggregates=aggregates, signer=signer, created_at_ms=1
    )
    plain_bytes = msgspec.msgpack.encode(aggregates)
    decoder = msgspec.msgpack.Decoder(list[Effect])
    bench.facts.update(
        aggregates=count,
        snapshot_bytes=len(snapshot),
        plain_state_bytes=len(plain_bytes),
        gc_during_plain_decode="paused during the decode, then one young-generation collection, as verify_snapshot",
    )

    def create(ctx: RoundContext) -> int:
        with ctx.timed():
            create_snapshot(
                org="acme",
                group="g-bench",
                seq=count,
                head_hash=HEAD_HASH,
                aggregates=aggregates,
                signer=signer,
                created_at_ms=1,
            )
        return 1

    state_encoder = msgspec.msgpack.Encoder(order="sorted")
    index_rows = [(a.aggregate, a.revision, msgspec.Raw(state_encoder.encode(a.state))) for a in aggregates]

    def create_from_index_bytes(ctx: RoundContext) -> int:
        with ctx.timed():
            create_snapshot(
                org="acme",
                group="g-bench",
                seq=count,
                head_hash=HEAD_HASH,
                aggregates=index_rows,
                signer=signer,
                created_at_ms=1,
            )
        return 1

    def plain_encode(ctx: RoundContext) -> int:
        with ctx.timed():
            blake3.blake3(msgspec.msgpack.encode(aggregates)).digest()
        return 1

    def verify(ctx: RoundContext) -> int:
        with ctx.timed():
            verified = verify_snapshot(snapshot, keyring=keyring, org="acme", group="g-bench", high_water_seq=count)
        assert len(verified.aggregates) == count
        return 1

    def plain_decode(ctx: RoundContext) -> int:
        with ctx.timed():
            blake3.blake3(plain_bytes).digest()
            gc.disable()
            try:
                decoded = decoder.decode(plain_bytes)
            finally:
                gc.enable()
            gc.collect(0)  # the young-generation pass verify pays on its next allocation
        assert len(decoded) == count
        return 1

    target = Target(
        "< 1 s and ≤ 2× plain encode + blake3", value_max=1.0, ratio_max={"plain": 2.0}
    )
    size = {"aggregates": count}
    if selected(args, "snapshot_create"):
        row = bench.row("snapshot_create", "snapshot create + sign", unit="s", target=target, size=size)
        row.compare({"mwpstore": create, "plain": plain_encode})
    if selected(args, "snapshot_create_from_index_bytes"):
        row = bench.row(
            "snapshot_create_from_index_bytes",
            "snapshot create + sign, states handed over as canonical msgpack (msgspec.Raw)",
            unit="s",
            target=target,
            size=size,
        )
        row.compare({"mwpstore": create_from_index_bytes, "plain": plain_encode})
        row.notes.append(
            "what Authority.snapshot costs if the index stores states with sorted keys: same snapshot bytes, no decode or re-encode"
        )
    if selected(args, "snapshot_verify"):
        row = bench.row("snapshot_verify", "snapshot verify (all checks, state decoded)", unit="s", target=target, size=size)
        row.compare({"mwpstore": verify, "plain": plain_encode, "plain_decode": plain_decode})
        row.notes.append(
            "plain_decode = blake3 + msgspec decode of the same bytes (GC paused): the floor for any verifier"
            " returning the aggregates"
        )
    bench.finish()


if __name__ == "__main__":
    main()
