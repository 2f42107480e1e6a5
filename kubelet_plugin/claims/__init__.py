"""The claim state machine: prepare and unprepare, the checkpoint that makes them crash-safe,
partitions made before binding, start-up reconcile, sharing and tenancy checks, reading claims
and writing their status.

This docstring is the one state table of a claim on this node. (No imports here: importing one
module of the package must not load the others.)

A claim's state is its record in the checkpoint (``checkpoint_records.ClaimRecord``, fields
``state`` and ``early``): one file per claim, ``<data dir>/claims/<uid>.json``, replaced
atomically (checkpoint.py), so a SIGKILL leaves the old record or the new one, never a mix. A
record lists what its claim creates or changes on the node (CDI spec, device metadata folder,
MIG instances, MPS share, time-slices) and is written *before* any of it is made, so it
always covers what may exist; undo (claim_undo.py) removes what it lists, wherever the work got
to, and skips what is gone.

States
------

    state            record                           what may exist on the node
    ---------------  -------------------------------  ----------------------------------------
    no record        none                             nothing of the claim
    PrepareStarted   state=PrepareStarted             any part of what the record lists (a
                                                      MIG instance found by placement until
                                                      its UUID is recorded)
    early Creating   PrepareStarted, early=Creating   some of its MIG partitions, nothing else
    early Ready      PrepareStarted, early=Ready      all its MIG partitions (UUIDs recorded),
                                                      nothing else
    Prepared         state=Prepared                   everything the record lists, the CDI
                                                      spec synced to disk
    removed          file deleted                     nothing: as no record (an unprepare of
                                                      it succeeds)

The early states are PrepareStarted records on purpose: a plugin that does not know ``early``
rolls them back like any half-done prepare.

The path of a call
------------------

The kubelet's prepare and unprepare reach the records through the claim pipeline
(pipeline.py), its stages in this order (main.py's ``claim_stages``); only the last moves a
state:

    stage            module                      what it does to a claim's state
    ---------------  --------------------------  ------------------------------------------
    start-up gate    startup_gate.py             none: holds the call while reconcile moves
                                                 records, or answers every claim with why
                                                 start-up has not finished
    metrics          observe/metrics.py          none: times the call, counts failed claims
                                                 by reason (only with a metrics port)
    tenancy          tenant_attribute.py         none: after the call, republishes each
                                                 shared GPU's ``tenant`` from the records
    preparer (end)   preparer.py                 every *prepare* and *unprepare* transition
                                                 below

*early* and *reconcile* moves do not pass the pipeline: the binding watch and start-up call
their modules directly.

Transitions
-----------

Made by: *prepare* and *unprepare* (preparer.py, the pipeline's end), *early* (the binding
watch's partitions made before binding, early_partitions.py; binding conditions, 1.36+),
*reconcile* (start-up, startup_reconcile.py). The first three hold the node lock shared, the
claim's lock and the locks of the GPUs its record touches (prepare_lock.py); reconcile holds
the node lock exclusive, and until it has finished the pipeline's start-up gate keeps prepare
and unprepare waiting.

    from -> to                       by          when
    -------------------------------  ----------  ------------------------------------------
    no record -> PrepareStarted      prepare     the claim read and allocated here, admitted
                                                 against the other records (prepare_checks)
    PrepareStarted -> Prepared       prepare     MIG instances made, sharing set, device
                                                 metadata files written, then the CDI spec
                                                 that mounts them
    PrepareStarted -> removed        prepare     a step failed: undone and deleted; the
                                                 claim's error goes to the kubelet
    PrepareStarted, early Creating   prepare     a half-done earlier attempt (a SIGKILL,
      -> removed -> PrepareStarted               another plugin process): undone, redone
    Prepared -> Prepared             prepare     a repeat: the recorded devices are returned
    any record -> removed            unprepare   undone from the record alone (the claim may
                                                 be gone), then deleted
    no record -> early Creating      early       an on-demand MIG device of the claim waits
                                                 for PartitionReady and conflicts with none
    early Creating -> early Ready    early       every partition created; PartitionReady is
                                                 written after the record
    early Creating -> removed        early       creating one failed: undone and deleted;
                                                 PartitionFailed written, the GPU tainted
    early Ready -> PrepareStarted    prepare     its partitions are the allocation's and
                                                 alive: taken over in one write (early
                                                 cleared, UUIDs kept), nothing made twice
    early Ready -> removed           prepare     partitions gone or not the allocation's:
      -> PrepareStarted                          undone, redone
    early Ready -> removed           early       its claim was deleted, deallocated or
                                                 allocated other partitions (release, sweep)
    PrepareStarted, early Creating   reconcile   rolled back: undone and deleted
      -> removed
    early Ready -> removed           reconcile   only while binding conditions are off; kept
                                                 otherwise, for prepare or the sweep
    Prepared -> Prepared             reconcile   kept as it is
    record of an earlier boot        reconcile   what it set is reset (settings may outlive a
      -> removed                                 reboot), the record dropped
    lost -> Prepared                 reconcile   a corrupt or newer-schema file: rebuilt from
                                                 a CDI spec of this boot (spec_facts.py),
                                                 checked against the API server

A record that cannot be written (a full disk) is no state of its own: prepare fails before it
changes anything, or undoes what it did when Prepared cannot be written (early partitions
alike, reported as PartitionFailed); a record reconcile rebuilt is held in memory, with an
Event saying so. After the records, reconcile removes what no record
owns: CDI specs, device metadata folders (metadata_files.py), MPS daemons and dynamic-MIG
instances that no record and no surviving spec uses, temp files of killed writes
(startup_leftovers.py).

What a SIGKILL leaves
---------------------

At each named step (``ClaimPreparerImpl.step``; the crash tests set ``FLEXGPU_FAULT_CRASH_AT``
to one): the record, what is on the node, and what comes next.

- ``prepare-locked``: no new record (an earlier one as it was), nothing changed. The kubelet,
  never answered, prepares again.
- ``after-prepare-started``: PrepareStarted, nothing made yet. Reconcile rolls it back.
- ``after-devices-created``: PrepareStarted and its MIG instances (UUIDs not yet recorded:
  found by placement). Rolled back.
- ``after-mps-started``: PrepareStarted, its MIG instances, MPS daemon and limits, time-slice.
  Rolled back.
- ``after-metadata-written``: PrepareStarted, all of it but the CDI spec: the request's device
  metadata files are written, no spec names them yet. Rolled back (the folder with it).
- ``after-cdi-written``: PrepareStarted and all of it, the CDI spec included. Rolled back; the
  kubelet prepares again.
- Prepared written: kept by reconcile; the kubelet's repeat gets the recorded devices.
- ``unprepare-locked``: the record unchanged. Reconcile treats it as its state says (Prepared:
  kept); the kubelet unprepares again.
- ``undo-mps-stopped`` (any undo): part of it undone, the record still there (deleted last).
  Reconcile treats it as its state says; the next undo skips what is gone.
- ``early-recorded``: early Creating, nothing made. Rolled back.
- ``early-created``: early Creating and some partitions. Rolled back.
- ``early-ready``: early Ready, PartitionReady perhaps not written. Kept while binding
  conditions are on: the binding watch writes PartitionReady again, or releases the partitions
  if the claim no longer waits for them.
"""
