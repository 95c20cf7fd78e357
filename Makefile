# specd: the README's commands. `make run` and `make test` set up .venv if needed.
#
# SMOKE=1 runs any target in a smoke mode, in seconds: the same commands on one or two prompts, a few
# tokens, a few seconds of load, nothing installed, built or deleted (install: the venv and the model
# are checked; run: the server starts, answers /readyz, stops; test / test-slow: the suite is collected;
# bench-deps: the build command is printed; clean: a scratch copy is cleaned). tests/test_make_targets.py
# runs every target so inside `make test`, so that none can break silently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

SHARED ?= ../shared
HOST ?= 127.0.0.1
PORT ?= 8765
SMOKE ?=

ifeq ($(SMOKE),1)
SMOKE_OUT ?= eval/out/smoke
THREADS := 1
PYTEST_ARGS := --collect-only -qq
LINT_PATHS := eval/__main__.py eval/serve_check.py
MYPY_FILES := specd/sampling/params.py
BENCH_PER_CATEGORY := 1
BENCH_TOKENS := 8
BENCH_BATCH := 1
BENCH_QUANT := gguf
BENCH_ARGS := --categories qa --profile-tokens 8 --systems specd:off,specd:chain:4,hf:generate,llamacpp:plain --no-progress
BENCH_OUT := $(SMOKE_OUT)/bench
EVAL_PER_CATEGORY := 1
EVAL_TOKENS := 8
EVAL_ARGS := --limit 1 --max-turns 1 --no-progress
EVAL_METHODS_ARGS := --categories qa
EVAL_OUT := $(SMOKE_OUT)/eval
SOAK_CLIENTS := 1
SOAK_MINUTES := 0.1
SOAK_ARGS := --max-tokens-set 8
SOAK_JSON := $(SMOKE_OUT)/soak.json
SCALE_SIZES := tiny
SCALE_FORMATS := f16
SCALE_THREADS := 1
SCALE_ARGS := --tokens 8 --reps 1 --passes 1
SCALE_CACHE := $(SMOKE_OUT)/scale-cache
SCALE_OUT := $(SMOKE_OUT)/scale
SCALE_PPL := --ctx 64 --chunks 1
SCALE_PPL_FILES :=
endif

.PHONY: install run test lint test-slow bench bench-deps bench-scale eval soak proto sysdeps clean

ifeq ($(SMOKE),1)
install:
	@test -x $(BIN)/python || { echo "install (smoke): no $(VENV): make install builds it"; exit 1; }
	$(BIN)/specd setup --quiet
	@if test $(STAMP) -nt pyproject.toml; then echo "install (smoke): $(VENV) is up to date with pyproject.toml"; \
	else echo "install (smoke): make install would reinstall (pyproject.toml is newer than $(STAMP))"; fi
else
install: $(STAMP)
endif

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/specd setup --quiet
	touch $(STAMP)

# the built-in model (SmolLM2-135M-Instruct, 93 MB from the package registry) on every usable CPU;
# smoke: the same flags through `python -m eval serve-check` (free ports, /readyz, SIGTERM)
RUN_FLAGS = --host $(HOST) --threads 0
run: install
ifeq ($(SMOKE),1)
	$(BIN)/python -m eval serve-check $(RUN_FLAGS)
else
	$(BIN)/specd serve $(RUN_FLAGS) --port $(PORT)
endif

PYTEST_ARGS ?= -q
test: install sysdeps lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# linters (issue #21): ruff rules + formatting over the whole tree, mypy on the core (pyproject.toml)
LINT_PATHS ?= .
MYPY_FILES ?=
lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy $(MYPY_FILES)

test-slow: install
	SPECD_SLOW=1 $(BIN)/python -m pytest $(PYTEST_ARGS) -m slow

# issue #16 item 6: the built-in pair on Spec-Bench's six categories, 256 new tokens, batch 1 and 4,
# specd plain/chain/tree vs transformers generate / prompt lookup vs llama.cpp (plain, prompt lookup);
# eval/out/bench_real/{summary.md,report.json,bench_real.png}. The llama.cpp systems need
# llama-cpp-python: built here by bench-deps when it is not importable (BENCH_LLAMA=0: never); if it
# cannot be built, those systems are skipped with a note.
THREADS ?= 2
BENCH_PER_CATEGORY ?= 8
BENCH_TOKENS ?= 256
BENCH_BATCH ?= 1,4
BENCH_DRAFT ?= models/smollm2-draft
BENCH_LLAMA ?= 1
BENCH_OUT ?= eval/out/bench_real
BENCH_ARGS ?=
# issue #19: specd's systems once per weight format (none = fp32 floats; gguf = the file's Q4_1/Q8_0 blocks)
BENCH_QUANT ?= none,int8,int4,gguf
BUILTIN = "$$($(BIN)/python -c 'from specd.model import builtin; print(builtin.builtin_gguf())')"
bench: install
	@test "$(BENCH_LLAMA)" = 0 || $(BIN)/python -c 'import llama_cpp' 2>/dev/null || $(MAKE) bench-deps || \
		echo "note: llama-cpp-python did not build: the llama.cpp systems will be skipped"
	$(BIN)/python -m eval bench --target $(BUILTIN) --draft $(BENCH_DRAFT) --prompts $(SHARED)/data/spec_bench/question.jsonl \
		--per-category $(BENCH_PER_CATEGORY) --max-tokens $(BENCH_TOKENS) --batch $(BENCH_BATCH) --threads $(THREADS) \
		--quantization $(BENCH_QUANT) --out $(BENCH_OUT) $(BENCH_ARGS)

# optional benchmark dependency (never a runtime one): llama-cpp-python, built from source for this CPU
# (OpenMP, -march=native, no multimodal library / tools / tests; a few minutes on 2 cores). On a CPU
# with AMX (Sapphire Rapids and later) -march=native builds ggml's AMX matmul, which segfaults in the
# first decode here (llama.cpp issue 20824): there it is built for AVX512 (VNNI, BF16) without AMX.
# Smoke: the flags this CPU gets and the commands, printed, nothing built.
LLAMA_ISA := $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null \
	&& echo -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON || echo -DGGML_NATIVE=ON)
LLAMA_CMAKE_ARGS ?= -DGGML_OPENMP=ON $(LLAMA_ISA) -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
LLAMA_UNINSTALL = $(BIN)/pip uninstall -q -y llama-cpp-python
LLAMA_BUILD = CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} \
	$(BIN)/pip install --no-cache-dir --no-binary llama-cpp-python 'llama-cpp-python>=0.3'
# ...and llama.cpp's tools (issue #42: llama-bench, llama-batched-bench, llama-quantize, llama-perplexity,
# llama-tokenize, llama-server) from the same sdist's vendored sources, same flags, into LLAMA_TOOLS
# (outside the repository; bench-scale and `python -m eval perplexity` look there), source in LLAMA_SRC
# (downloaded once: an existing one is reused, so the build is incremental)
LLAMA_TOOLS ?= $(HOME)/.cache/specd/llama.cpp
LLAMA_SRC ?= $(LLAMA_TOOLS)/src
LLAMA_TOOL_TARGETS := llama-bench llama-batched-bench llama-quantize llama-perplexity llama-tokenize llama-server
LLAMA_TOOLS_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=Release -DGGML_OPENMP=ON $(LLAMA_ISA) -DLLAMA_CURL=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
LLAMA_FETCH = test -d $(LLAMA_SRC)/vendor/llama.cpp || { mkdir -p $(LLAMA_SRC) && \
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(LLAMA_SRC) 'llama-cpp-python>=0.3' && \
	tar xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC) --strip-components=1; }
LLAMA_TOOLS_BUILD = cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_TOOLS)/build $(LLAMA_TOOLS_CMAKE_ARGS) && \
	cmake --build $(LLAMA_TOOLS)/build -j$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} --target $(LLAMA_TOOL_TARGETS)
bench-deps:
ifeq ($(SMOKE),1)
	$(info bench-deps (smoke): would run: $(LLAMA_UNINSTALL))
	$(info bench-deps (smoke): would run: $(LLAMA_BUILD))
	$(info bench-deps (smoke): would run: $(LLAMA_FETCH))
	$(info bench-deps (smoke): would run: $(LLAMA_TOOLS_BUILD))
	@test -x $(BIN)/python || echo "bench-deps (smoke): would create $(VENV) first ($(PY) -m venv $(VENV))"
else
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(LLAMA_UNINSTALL)  # (a cached wheel would keep the old build flags)
	$(LLAMA_BUILD)
	$(LLAMA_FETCH)
	$(LLAMA_TOOLS_BUILD)
endif

# issue #42 item 5: shape-true random-weight GGUFs (SmolLM2-1.7B, Llama-3.2-3B, Llama-3.1-8B; f16 from the
# gguf package into SCALE_CACHE, quantized by llama-quantize): specd plain decode vs llama-bench /
# llama-batched-bench at batch 1 and 4, 1 and 2 threads, the cost of 1..32 verification rows and the
# depth auto picks from them, each step against the memory-bandwidth floor measured in the same run;
# then perplexity as llama-perplexity scores it vs llama-perplexity on the built-in model and
# SCALE_PPL_FILES (eval/out/bench_scale/{summary.md,results.json}, eval/out/perplexity-*). The llama.cpp
# tools are built by bench-deps when missing (if they cannot be, their columns are left empty with a
# note). The 8B f16 file is 16 GB: SCALE_SIZES=1.7b,3b leaves it out. Smoke: a tiny shape, f16, 8 tokens.
SCALE_SIZES ?= 1.7b,3b,8b
SCALE_FORMATS ?= q4_0,q4_k_m,q8_0
SCALE_THREADS ?= 1,2
SCALE_ARGS ?=
SCALE_CACHE ?= $(HOME)/.cache/specd/bench-scale
SCALE_OUT ?= eval/out/bench_scale
SCALE_PPL ?= --ctx 512 --chunks 8
SCALE_PPL_FILES ?= $(SCALE_CACHE)/1.7b-q4_k_m.gguf
bench-scale: install
ifeq ($(SMOKE),1)
	@test -x $(LLAMA_TOOLS)/build/bin/llama-bench || \
		echo "bench-scale (smoke): no llama.cpp tools under $(LLAMA_TOOLS): make bench-deps would build them"
else
	@test -x $(LLAMA_TOOLS)/build/bin/llama-bench || $(MAKE) bench-deps || \
		echo "note: llama.cpp's tools did not build: the llama.cpp columns will be empty"
endif
	$(BIN)/python -m eval bench scale --sizes $(SCALE_SIZES) --formats $(SCALE_FORMATS) --threads $(SCALE_THREADS) \
		--cache $(SCALE_CACHE) --llama-tools $(LLAMA_TOOLS) --out $(SCALE_OUT) $(SCALE_ARGS)
	for f in $(BUILTIN) $(SCALE_PPL_FILES); do \
		$(BIN)/python -m eval perplexity --target $$f --threads $(THREADS) --llama-tools $(LLAMA_TOOLS) $(SCALE_PPL) \
			--out $(SCALE_OUT)/perplexity-$$(basename $$f .gguf) || exit 1; \
	done

# acceptance and speedup per category on the built-in pair (Spec-Bench and MT-bench), with the theory check;
# then the feature head, prompt lookup and `auto` per Spec-Bench category as served (int8 activations)
EVAL_PER_CATEGORY ?= 2
EVAL_TOKENS ?= 128
EVAL_OUT ?= eval/out
EVAL_ARGS ?=
EVAL_METHODS_ARGS ?=
eval: install
	for set in spec_bench mt_bench; do \
		$(BIN)/python -m eval accept --target $(BUILTIN) --draft models/smollm2-draft \
			--prompts $(SHARED)/data/$$set/question.jsonl --per-category $(EVAL_PER_CATEGORY) \
			--max-tokens $(EVAL_TOKENS) --modes off,chain:4,tree:16 --temperature 0 --threads $(THREADS) \
			--out $(EVAL_OUT)/$$set $(EVAL_ARGS) || exit 1; \
	done
	$(BIN)/python -m eval accept methods --per-category $(EVAL_PER_CATEGORY) --max-tokens $(EVAL_TOKENS) --threads $(THREADS) \
		--act-quant int8 --methods plain,head-chain,head-tree,ngram,auto --chain 2 --out $(EVAL_OUT)/head $(EVAL_METHODS_ARGS)

SOAK_CLIENTS ?= 8
SOAK_MINUTES ?= 3
SOAK_JSON ?= eval/out/soak.json
SOAK_ARGS ?=
soak: install
	$(BIN)/python -m eval load soak --clients $(SOAK_CLIENTS) --minutes $(SOAK_MINUTES) --json $(SOAK_JSON) $(SOAK_ARGS)

# system packages the tests drive (headless Chromium for the web page, systemd-analyze for the unit);
# smoke: what is there, and the command that would install the rest
SYSDEPS_HAVE = command -v chromium >/dev/null && command -v systemd-analyze >/dev/null && \
	(command -v nginx >/dev/null || test -x /usr/sbin/nginx)
SYSDEPS_APT = apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium systemd nginx >/dev/null
sysdeps:
ifeq ($(SMOKE),1)
	@$(SYSDEPS_HAVE) && echo "sysdeps (smoke): chromium, systemd-analyze and nginx are installed" || \
		echo "sysdeps (smoke): some are missing: make sysdeps would run: $(SYSDEPS_APT)"
else
	@$(SYSDEPS_HAVE) || ($(SYSDEPS_APT)) || \
		echo "warning: could not install chromium/systemd/nginx (need root): the web-page and unit tests will fail, the load-balancer test will skip"
endif

# the gRPC code from proto/; smoke: generated into a scratch folder and compared with the committed code
PROTOC = $(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$$out --pyi_out=$$out --grpc_python_out=$$out \
	proto/specd/v1/specd.proto && \
	perl -pi -e 's/^from specd\.v1 import/from specd.serving.proto.specd.v1 import/' $$out/specd/v1/specd_pb2_grpc.py
proto: install
ifeq ($(SMOKE),1)
	out=$$(mktemp -d) && $(PROTOC) && \
		diff -r -I '^GRPC_GENERATED_VERSION' -x __init__.py -x __pycache__ $$out/specd/v1 specd/serving/proto/specd/v1 && \
		rm -rf $$out && echo "proto (smoke): the generated code matches specd/serving/proto"
else
	out=specd/serving/proto && $(PROTOC)
endif

# smoke: the same command in a scratch folder holding a fake venv, build and egg-info
CLEAN = rm -rf $(VENV) build *.egg-info
clean:
ifeq ($(SMOKE),1)
	@d=$$(mktemp -d) && mkdir -p $$d/$(VENV)/bin $$d/build $$d/specd.egg-info && (cd $$d && $(CLEAN)) && \
		test -z "$$(ls -A $$d)" && rmdir $$d && \
		echo "clean (smoke): '$(CLEAN)' emptied a scratch copy; $(VENV) here is untouched"
else
	$(CLEAN)
endif
