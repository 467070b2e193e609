"""The operator's side: is anyone still using a region file, and removing it when not.

``kvoffload.shm`` is the engine's side (names, the region, the owner record it writes);
this package only judges and removes what engines left, one behaviour a module. Each source
of evidence has one module that answers for a file; ``verdict`` combines them and writes the
reason from whichever evidence decided::

    evidence
      lease.py       write lease: no other open file description anywhere on the kernel
      watchdog.py    kills a lease holder left stopped while an engine waits on its lease
      lock.py        kvoffload's flock(LOCK_SH): a participant, in any namespace
      holders.py     the /proc pass: names holders, finds mapped-but-deleted regions
      ownership.py   the owner record: a hint that names the creator (never proof alone)
      namespace.py   whether this /proc shows every process on the host
      probe.py       one file's own evidence from one open: owner record, lease, lock
      prober.py      probes in a forked child beside the /proc pass: a scan on two cores
    verdict.py       evidence -> live / orphaned / starting / unknown, with the reason
    scan
      scan.py        the scan's settings (ScanOptions), the root, judging each region
      listing.py     a root's region files: listed, lstat'ed, sorted into regions to judge
      report.py      what a scan reports: entries, summary, report (schema version)
    park/            everything about park directories: the reaper's own (directory), which
                     ones are a reaper's (trust), their views, what waits in them (parked),
                     settling what a dead reaper left (settle)
    reap
      reap.py        remove what scan called orphaned, the operator's filters, the report
      removal.py     the removal protocol: proven dead again, parked, proven, unlinked
    the agent (shmctl watch)
      roots.py       --root patterns, the walk that never follows a symlink, root identity
      events.py      what the agent tells: every event, the pass and root reports
      watch.py       WatchConfig and the Watcher's loop over passes and roots
      watch_reap.py  what watch --reap removes in one root's turn, and tells
      tally.py       one root's numbers in a pass, added a region at a time
    audit.py         run a command, report what it left behind
    guard.py         the old name of watchdog.py, kept for one release (issue #29)
"""
