"""mwpstore: an embedded, single-node storage engine for the Mission Work Protocol."""
