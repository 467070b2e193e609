"""`make vllm-compat`: vLLM 0.33's own offloading tests, run against vLLM and against kvoffload.

Run it from the repository's top as ``python -m compat.vllm_compat`` (``cli`` has its steps,
arguments and exit status). One module per concern, in the order a run meets them:

* ``scope``: vLLM's version and sdist, the test scopes in it, discovering their test files;
* ``sdist``: finding the sdist through pip's own index configuration, downloading, unpacking;
* ``pins``: every pin of ``compat/requirements.txt`` within vLLM's declared ranges;
* ``environment``: the runs' venv, and the offline Hugging Face hub cache of ``compat/hf``;
* ``isolation``: each run in a process group killed whole, in a private tmpfs over ``/dev/shm``
  (``compat/vllm_engine/`` runs its scenarios with it too);
* ``runs``: one pytest process over one file, on vLLM or on kvoffload (``compat/adapter``);
* ``junit``: its per-test outcomes, from pytest's JUnit XML;
* ``outcomes``: a test's outcome, and what it is once its failures were run again;
* ``differences``: the deliberate differences of ``compat/differences.toml``;
* ``comparison``: one file's row, both sides compared test by test;
* ``tables``: ``results.md``, the table and what follows it;
* ``cli``: the arguments and ``main``; ``errors``: ``SetupError`` (exit 2).

Modules import each other relatively, so the package works by either name: ``compat.vllm_compat``
from the repository's top, ``vllm_compat`` with ``compat/`` on the path (``compat/vllm_engine/``
and the tests import it so).
"""
