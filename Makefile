# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Every target creates .venv on first use; every cache lives under build/cache.
SHELL := /bin/bash
# Any Python from 3.11 to 3.13 (pyproject's requires-python); the first of these found, else PYTHON=...
PYTHON ?= $(firstword $(foreach p,python3.11 python3.12 python3.13 python3,$(shell command -v $(p))))
VENV := .venv
BIN := $(VENV)/bin
BUILD := $(CURDIR)/build
CACHE := $(BUILD)/cache
STAMP := $(VENV)/.installed
# The test extra (pytest, JupyterHub and its spawners, Playwright): only the targets that need it.
TEST_STAMP := $(VENV)/.installed-test

# nbgrader calls `alembic` by name, so the venv's bin/ goes first on PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)
export TRITON_CACHE_DIR := $(CACHE)/triton
export TORCHINDUCTOR_CACHE_DIR := $(CACHE)/inductor
export TORCH_EXTENSIONS_DIR := $(CACHE)/torch_extensions
export JUPYTER_RUNTIME_DIR := $(CACHE)/jupyter/runtime
export JUPYTER_DATA_DIR := $(CACHE)/jupyter/data
export JUPYTER_CONFIG_DIR := $(CACHE)/jupyter/config
export IPYTHONDIR := $(CACHE)/ipython
export MPLCONFIGDIR := $(CACHE)/matplotlib
export XDG_CACHE_HOME := $(CACHE)/xdg
export MPLBACKEND := Agg
# npm's own download cache, kept with the others rather than in $HOME.
export npm_config_cache := $(CACHE)/npm-cache

.PHONY: demo test test-e2e test-image-stack lab lab-instructor grade progress build venv clean sandbox-tool c-compiler hub hub-proxy slides slides-tool browser-tool bench-gpu gpu-class

# TORCH_INDEX=https://download.pytorch.org/whl/cpu make venv: torch from that index as well as PyPI
# (there, the CPU-only wheel instead of the CUDA build and its libraries, for a laptop without an NVIDIA GPU).
TORCH_INDEX ?=
TORCH_INDEX_ARG = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
, := ,
# $(call install,EXTRAS,WHAT): a Python the course can use, the venv made where missing, then one pip
# run of the package with EXTRAS ("" or "[test]").
define install
@test -n "$(PYTHON)" && command -v $(PYTHON) >/dev/null || { echo "needs Python 3.11, 3.12 or 3.13: none found (say PYTHON=...)"; exit 1; }
@$(PYTHON) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 14))' || \
  { echo "$(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); the course needs 3.11 to 3.13 (say PYTHON=...)"; exit 1; }
@[ "$$(uname -s)" != Darwin ] || { echo "macOS: Triton, which runs every lab's kernels, publishes no macOS wheel," \
  "so the course cannot be installed here. Use Linux, WSL2 on Windows, or a Linux virtual machine" \
  "(README: Platforms)."; exit 1; }
test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
@echo "$(2)"
$(BIN)/pip install --disable-pip-version-check -e '.$(1)' --config-settings editable_mode=compat $(TORCH_INDEX_ARG)
endef
COURSE_PACKAGES := the course's Python packages into $(VENV) (torch, Triton, JupyterLab, nbgrader and the rest): \
  2.8 GB, 4-5 minutes the first time on the 2-core machine; pip lists each package as it goes

$(STAMP): pyproject.toml
	$(call install,,installing $(COURSE_PACKAGES))
	touch $@

# The test extra. Where the course's packages are not installed yet, they come in the same pip run
# (one resolution and one install, not two), and both stamps are then up to date.
$(TEST_STAMP): pyproject.toml
	$(call install,[test],installing $(if $(wildcard $(STAMP)),the test extra into $(VENV),$(COURSE_PACKAGES)$(,) with the test extra) (pytest, JupyterHub with its spawners and authenticators, Playwright))
	touch $(STAMP) $@

venv: $(STAMP)

# $(call apt-tool,COMMAND,PACKAGE,WHAT FOR,WITHOUT IT): install a Debian package where we are root,
# else say what to install and what does not work until then.
define apt-tool
@command -v $(1) >/dev/null || { \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
    echo "installing $(2) with apt-get: $(3)"; \
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(2); \
  else \
    echo "$(1) is missing and cannot be installed from here: run 'sudo apt-get install $(2)'. $(4)"; \
  fi; }
endef

# The grader runs student code only inside bubblewrap (autograder/engine/bwrap.py).
WITHOUT_SANDBOX := Until then grading refuses to run student code; make grade LAB=NN UNSAFE=1 checks your own \
  notebook without it.
sandbox-tool:
	$(call apt-tool,bwrap,bubblewrap,the grader's sandbox,$(WITHOUT_SANDBOX))

# The browser tests drive Debian's Chromium with Playwright's Python package (executable_path,
# over the DevTools protocol, so no chromedriver): the browser comes from apt, never Playwright's own.
browser-tool:
	$(call apt-tool,chromium,chromium,the browser of the browser tests,Until then the browser tests are skipped.)

# On a GPU host Triton compiles a small C launcher the first time a kernel runs, with $CC, gcc or
# clang (what triton/runtime/build.py looks for); without one every first launch fails. A CPU host
# runs kernels under the interpreter and needs none.
c-compiler:
	@if nvidia-smi -L >/dev/null 2>&1 && ! { [ -n "$$CC" ] && command -v $${CC%% *} >/dev/null; } \
	    && ! command -v gcc >/dev/null && ! command -v clang >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing gcc: Triton builds its kernel launcher with it on this GPU host"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc; \
	  else \
	    echo "This GPU host has no C compiler (CC, gcc or clang), which Triton needs to launch any kernel:" \
	         "run 'sudo apt-get install gcc', or 'conda install -c conda-forge gcc' in the conda environment," \
	         "or set CC. Until then every Triton kernel fails on its first launch."; \
	  fi; \
	fi

# Lecture decks: Marp CLI from the npm registry, installed under build/cache (nothing global).
MARP_CLI_VERSION := 4.5.1
NPM_PREFIX := $(CACHE)/npm
MARP := $(NPM_PREFIX)/node_modules/.bin/marp
$(MARP):
	@command -v npm >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Node.js and npm, which build the slides"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm; \
	  else \
	    echo "npm is missing and cannot be installed from here: run 'sudo apt-get install nodejs npm'."; exit 1; \
	  fi; }
	mkdir -p $(NPM_PREFIX)
	@echo "installing Marp CLI $(MARP_CLI_VERSION) from the npm registry into $(NPM_PREFIX): 136 MB, about 20 s on 2 cores"
	npm install --prefix $(NPM_PREFIX) --no-audit --no-fund --loglevel=error @marp-team/marp-cli@$(MARP_CLI_VERSION)

slides-tool: $(MARP)

# Every deck in slides/ to build/slides/NN_*.html with its figures in build/slides/figures/:
# open a page from the file system, no network needed (the build checks that).
slides: $(STAMP) slides-tool
	rm -rf $(BUILD)/slides
	$(BIN)/python slides/build_decks.py $(BUILD)/slides

demo: $(STAMP) sandbox-tool c-compiler
	$(BIN)/python -m autograder demo

# The suite, under 20 minutes on the 2-core machine; the end-to-end tests (a real JupyterHub, a
# real browser; their time is stated once, in the README) run with make test-e2e. Much of the
# suite is one Python process busy at a time, so two workers share the files (each file on one
# worker: its module fixtures are made once); the graded demo class, the longest file, starts
# first (tests/conftest.py).
TEST_WORKERS ?= 2
# The cores shared out between the workers: torch's thread pools default to one thread per core,
# and two processes spinning pools on the same cores slow each other down.
TEST_THREADS ?= $(shell n=$$(( $$(nproc) / $(TEST_WORKERS) )); [ $$n -ge 1 ] && echo $$n || echo 1)
test: $(TEST_STAMP) sandbox-tool c-compiler
	@$(MAKE) --no-print-directory slides-tool || echo "Marp CLI could not be installed: the slide test is skipped"
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -m "not e2e" -n $(TEST_WORKERS) --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The stack the lent GPU machines carry (Python 3.12, torch 2.11 built for CUDA 13, Triton 3.6), on
# this machine's CPU: every test that needs only torch, Triton and the scientific stack, run from the
# source tree (PYTHONPATH) as on such a machine. Downloads about 4.5 GB into build/image-stack the
# first time. NumPy stays below 2.4: Triton 3.6's interpreter fails with 2.4 (triton-lang/triton#9171).
IMAGE_PYTHON ?= python3.12
IMAGE_TORCH ?= 2.11.0
IMAGE_TRITON ?= 3.6.0
IMAGE_NUMPY ?= numpy<2.4
IMAGE_STACK := $(BUILD)/image-stack
IMAGE_TESTS := $(addprefix tests/,test_compiled_launch_configs.py test_kernel_report.py test_softmax_ptx.py \
  test_layernorm_ptx.py test_attention_ptx.py test_optim_ptx.py test_quant_ptx.py test_triton_aot.py test_gemm.py \
  test_softmax.py test_layernorm.py test_attention.py test_rowsum.py test_optim.py test_quant.py test_amp.py \
  test_fusion.py test_timing.py test_timing_events.py test_device.py test_bounds.py test_checks.py test_measure.py \
  test_simt.py test_distributed_launch.py test_distributed_ddp.py test_distributed_ring.py test_distributed_ps_zero.py \
  test_distributed_fsdp.py test_distributed_tensor_parallel.py test_data_loop.py test_data_syncs.py \
  test_data_loaders.py test_data_profile.py test_data_text.py test_tabular.py test_custom.py)
test-image-stack: sandbox-tool c-compiler
	@$(IMAGE_PYTHON) -c pass 2>/dev/null || { echo "needs a Python 3.12 that runs as $(IMAGE_PYTHON) (say IMAGE_PYTHON=...)"; exit 1; }
	test -x $(IMAGE_STACK)/venv/bin/python || $(IMAGE_PYTHON) -m venv $(IMAGE_STACK)/venv
	@echo "installing the lent GPU machines' stack into $(IMAGE_STACK)/venv (about 4.5 GB the first time, when pip lists" \
	  "each package; quiet once it is there)"
	$(IMAGE_STACK)/venv/bin/pip install $(if $(wildcard $(IMAGE_STACK)/venv/bin/python),--quiet) \
	  --disable-pip-version-check torch==$(IMAGE_TORCH) \
	  triton==$(IMAGE_TRITON) "$(IMAGE_NUMPY)" pytest pytest-xdist matplotlib pandas scikit-learn pillow ninja \
	  pyarrow "dask[dataframe]" distributed tqdm
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) FASTDL_TORCH_PCH=$(IMAGE_STACK)/pch OMP_NUM_THREADS=$(TEST_THREADS) \
	  $(IMAGE_STACK)/venv/bin/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(IMAGE_TESTS)

test-e2e: $(TEST_STAMP) sandbox-tool hub-proxy browser-tool
	$(BIN)/python -m pytest -m e2e

build: $(STAMP) sandbox-tool c-compiler
	$(BIN)/python -m autograder build

# Student mode: the release notebooks, copied once into the working folder (work/, kept by
# `make clean` and ignored by git), run by the `fastdl-student` kernel, which imports the student
# copy of the package (no solutions). The command and its settings (deploy/jupyter/selfstudy:
# Validate only, no news, the kernel started on opening) are defined once, in
# autograder/selfstudy.py, which the browser test starts too. LAB_ARGS go to JupyterLab.
WORK := $(CURDIR)/work
LAB_SETTINGS := $(CACHE)/jupyter/lab-settings
lab: $(STAMP)
	FASTDL_WORK_DIR=$(WORK) $(BIN)/python -m autograder lab $(LAB_ARGS)

# Instructor mode: labs/*.py with their solutions, opened as notebooks through jupytext.
lab-instructor: $(STAMP)
	mkdir -p $(LAB_SETTINGS)/@jupyterlab/docmanager-extension
	echo '{"defaultViewers": {"python": "Jupytext Notebook"}}' \
	  > $(LAB_SETTINGS)/@jupyterlab/docmanager-extension/plugin.jupyterlab-settings
	cd labs && env -u MPLBACKEND JUPYTERLAB_SETTINGS_DIR=$(LAB_SETTINGS) ../$(BIN)/jupyter lab --allow-root \
	  --ServerApp.contents_manager_class=jupytext.TextFileContentsManager \
	  --ContentsManager.default_jupytext_formats="py:percent"

# Self-grading of the working copy: make grade LAB=02; make progress shows every lab.
# UNSAFE=1 checks it without the sandbox, where bubblewrap cannot run (no user namespaces, not
# Linux): for the learner's own notebook only, and every line of the result says UNSAFE.
ifneq ($(filter-out 0 1,$(UNSAFE)),)
$(error UNSAFE=$(UNSAFE): say UNSAFE=1 to check your own notebook without the sandbox, or leave UNSAFE out)
endif
grade: $(STAMP) $(if $(filter 1,$(UNSAFE)),,sandbox-tool) c-compiler
	@test -n "$(LAB)" || { echo "say which lab: make grade LAB=02"; exit 2; }
	FASTDL_WORK_DIR=$(WORK) $(BIN)/python -m autograder check $(LAB)$(if $(filter 1,$(UNSAFE)), --unsafe-no-isolation)

progress: $(STAMP)
	FASTDL_WORK_DIR=$(WORK) $(BIN)/python -m autograder progress

# JupyterHub's proxy is a Node program from the npm registry, kept under build/cache (never installed
# globally). Without Node and no way to install it, `make test` goes on and the hub test says why it skips.
PROXY_PREFIX := $(CACHE)/npm
PROXY := $(PROXY_PREFIX)/node_modules/.bin/configurable-http-proxy
hub-proxy:
	@test -x $(PROXY) || { \
	  command -v npm >/dev/null || { \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      echo "installing Node.js and npm, which run JupyterHub's proxy"; \
	      apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm; \
	    fi; }; \
	  if command -v npm >/dev/null; then \
	    echo "installing configurable-http-proxy from the npm registry into $(PROXY_PREFIX): 9 MB, about 4 s on 2 cores"; \
	    npm install --silent --no-audit --no-fund --prefix $(PROXY_PREFIX) configurable-http-proxy@5 || \
	      echo "npm could not install configurable-http-proxy: 'make hub' and the hub test need it"; \
	  else \
	    echo "npm is missing and cannot be installed from here: run 'sudo apt-get install nodejs npm'." \
	         "Until then 'make hub' cannot start and the hub test is skipped."; \
	  fi; }

# The course's JupyterHub on 127.0.0.1:8000 to try it (deploy/trial.py; HUB_ARGS="--port 8001 --rebuild").
hub: $(TEST_STAMP) sandbox-tool hub-proxy c-compiler
	$(BIN)/python deploy/trial.py $(HUB_ARGS)

clean:
	rm -rf $(BUILD)

# On a GPU host, within a ten-minute budget: the GPU tests (gpu-marked and the kernel tests), the
# benchmarks' GPU specs (headline kernels first, as many as the budget leaves time for), rows with
# the GPU's name, driver and clocks in benchmarks/results/, and a proposal of speed thresholds for
# the GPU's profile (benchmarks/results/calibration_<profile>.json) for a person to review. On a
# CPU host it says so and succeeds. Runs from the source tree with .venv's Python if there is one,
# else $(PYTHON) as it is (a GPU image's own torch and Triton): nothing is installed. An exported
# TRITON_INTERPRET is dropped: it would run every kernel on the CPU.
BENCH_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
bench-gpu:
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) $(BENCH_PYTHON) benchmarks/gpu.py $(BENCH_ARGS)


# On a GPU host: the demo class of every lab (reference, untouched, every buggy demo) graded as
# `autograde` grades, sandboxed, on the GPU's profile; one row per item in
# benchmarks/results/gpu_class.csv; exits 1 unless the class scores as its demos promise
# (CLASS_ARGS="--labs 01,05 --nbgrader --seed N"). On a CPU host it says what it would grade and
# succeeds. Same Python and source tree as bench-gpu.
gpu-class:
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) $(BENCH_PYTHON) benchmarks/gpu_class.py $(CLASS_ARGS)
