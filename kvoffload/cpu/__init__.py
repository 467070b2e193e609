"""CPU offloading, at vLLM's module paths (``kv_offload/cpu/*``) plus two rooms of our own.

* ``spec``: ``CPUOffloadingSpec``: sizing, the scheduler-side manager, the worker-side region;
* ``manager``: ``CPUOffloadingManager``, the scheduler's bookkeeping of the chunk pool, and
  ``policies``, its cache policies (LRU, ARC);
* ``gpu_worker``: ``CPUOffloadingWorker``, which moves KV blocks between the GPU cache and
  the region, through ``block_copy`` (the direct layout) or ``canonical_layout``, pinning the
  mapping with ``host_register``;
* ``common``: the load/store spec, metric names and info labels the others share;
* ``shared_offload_region``: vLLM's ``SharedOffloadRegion``, the region in the shm root (its
  creator/joiner protocol, sizing, mapping, views and cleanup);
* ``segments`` (ours): how a region is split into files, as vLLM splits it;
* ``prefault`` (ours): the threaded pre-fault of a region's mapping that ``populate`` runs.
"""
