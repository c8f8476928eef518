"""torpor.sandbox.storage: what outlives a machine, on the host's disk (chunks optionally in
S3-compatible object storage).

* :mod:`.chunks` — the content-addressed chunk store (sha256, zstd, deduplicated, verified)
* :mod:`.chunk_backends` — where chunks are kept: the interface and the local directory
* :mod:`.object_store` — chunks in S3-compatible object storage, with a bounded node cache
* :mod:`.tiered` — a node's own chunks in front of a shared store (cluster snapshots: saved
  locally, pushed in the background, read from either)
* :mod:`.snapshots` — immutable, verified snapshots (manifests over chunks), freezing a
  machine directory
* :mod:`.manifests` — what a snapshot's manifest holds (:class:`~.manifests.SnapshotInfo`) and
  the store's reading half: list, find, push, scrub
* :mod:`.backing` — qcow2 backing chains read from the headers; folding local layers into one
* :mod:`.catalog` — where snapshot manifests are recorded: the home's files, or (cluster
  mode) the PostgreSQL registry
* :mod:`.volumes`, :mod:`.volume_files` — disk images that outlive sandboxes; reading a file
  from one without a VM
* :mod:`.drives` — host directories shared read-write into many sandboxes (virtio-9p)
* :mod:`.records` — the JSON record store volumes and drives share (atomic writes, locks)
* :mod:`.retention` — garbage collection: what no snapshot, sandbox or template needs

Imports: torpor.config, torpor.errors, torpor.sandbox.vm (disk utilities only); boto3 only
when an ``s3://`` store is opened.
"""
