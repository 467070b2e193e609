"""The operator's side: is anyone still using a region file, and removing it when not.

``kvoffload.shm`` is the engine's side (names, the region, the owner record it writes);
this package only judges and removes what engines left. Each source of evidence has one
module that answers for a file; ``verdict`` combines them and writes the reason from
whichever evidence decided::

    lease.py     write lease: no other open file description anywhere on the kernel
    lock.py      kvoffload's flock(LOCK_SH): a participant, in any namespace
    holders.py   the /proc pass: names holders, finds mapped-but-deleted regions
    ownership.py the owner record: a hint that names the creator (never proof alone)
    namespace.py whether this /proc shows every process on the host
    verdict.py   evidence -> live / orphaned / starting / unknown, with the reason
    scan.py      list the root, gather the evidence, judge each region
    reap.py      remove what scan called orphaned, proving it again under the lease
    audit.py     run a command, report what it left behind
"""
