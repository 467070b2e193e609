"""The agent's HTTP side: what ``shmctl watch --listen`` serves, from what, and how.

* ``server``: the WSGI server, one selector thread and bounded pools, with a connection cap
  and timeouts, so that no client can take the fds, threads or memory the scan needs
  (docs/watch-http.md). It knows nothing of the agent.
* ``state``: ``WatchMetrics``, the latest numbers of every watched root and the reap counters,
  recorded by the pass loop and read per scrape; bounded however many roots come and go.
* ``agent``: the agent's WSGI app (``/metrics``, ``/healthz``), ``--listen``'s address, and
  binding it before the first pass (``serving``).

Nothing here formats: the exposition is ``shmctl.render.metrics``'s, the diagnostic lines
``shmctl.render``'s. ``state`` and ``agent`` import prometheus-client, so only ``watch``'s
code path imports them: ``shmctl --help`` and shell completion never do.
"""
