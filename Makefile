# `make run`: set up .venv on first use, then the main job (a sharded training run on CPU).
# `make test`: set up .venv on first use, then lint and the whole test suite.
PY ?= python3
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean gpu-check test-fast

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0, asked for as the CPU build (`+cpu`) first: a bare `torch==2.13.0` on a plain
	# public index for Linux is the multi-GB CUDA build. Where no index or find-links serves a
	# `+cpu` wheel, say so and take what the index serves. TORCH_INDEX=URL adds an index
	# (e.g. PyTorch's CPU wheel index) for a machine that can reach one.
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) 'torch==2.13.0+cpu' \
	  || { echo "make: no CPU build of torch 2.13.0 on the configured indexes;" \
	       "installing torch==2.13.0 as served (on a plain public Linux index: the CUDA build)"; \
	       $(BIN)/pip install -q torch==2.13.0; }
	$(BIN)/python -c "import torch; print('make: installed torch', torch.__version__)"
	$(BIN)/pip install -q -e '.[test,frameworks]'
	# torchtitan 0.3.0 pins datasets<4.8, wandb and tensorboard, none of which the pieces the
	# tests drive (model, parallelize, loss, optimizer, DCP checkpointer) import; installing them
	# would pull hundreds of MB. (The test extra brings its own datasets, for parquet and saved
	# dataset input, and wandb and tensorboard for the metric sinks: --no-deps leaves them as
	# they are.) So: torchtitan alone, and what
	# it needs to import on CPU from the `frameworks` extra. torch stays 2.13.0 (checked below).
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0
	$(BIN)/pip list 2>/dev/null | grep -q '^torch  *2\.13\.0' || (echo "torch is not 2.13.0" && exit 1)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/shardwise train

# Test files run side by side on TEST_JOBS pytest-xdist workers ([Note: parallel files] in
# tests/conftest.py): much of a multi-process test is start-up and waiting between ranks, so
# two workers keep a 2-core machine busier. TEST_JOBS=0 runs them one after another.
TEST_JOBS ?= 2

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadgroup --durations=25 tests

# `make test-fast`: ruff and a quick tier for a time-limited CI: the unit tests but the slow
# ones (CLI subprocesses, torchrun launches, multi-rank property runs; deselected by node-id
# prefix), and a handful of multi-process tests: parity against unsharded training at 2 and 3
# ranks, FSDP2's per-step collective counts, checkpoints across world sizes and a small file
# of the ported FSDP2 grid. 1 min 22 s on an idle 2-core machine (it took 4.5 min before the
# planner's shard balance stopped walking every rank). `make test` stays the whole suite.
FAST_TESTS := tests/unit \
  tests/dist/test_parity.py::test_parity_grid[2] tests/dist/test_parity.py::test_parity_grid[3] \
  tests/dist/test_parity.py::test_gloo_native_collectives_agree \
  tests/dist/test_collective_counts.py tests/dist/test_checkpoint.py \
  tests/dist/fsdp2/test_clip_grad_norm.py
FAST_SKIP := $(addprefix --deselect tests/unit/,\
  test_bad_input.py::test_two_ranks_all_raise_before_any_collective \
  test_bad_input.py::test_cli_subprocess_exit_2 test_plan_tp.py::test_cli_tp \
  test_checkpoint_kill.py test_launch.py::test_values_and_no_temporary_folders \
  test_launch.py::test_expected_errors_are_one_line_and_crashes_carry_a_traceback \
  test_security.py::test_cli_binds_loopback_by_default_and_warns_for_other_hosts \
  test_metric_sinks.py::test_wandb_offline_run_read_back \
  test_plan_verdicts.py::test_print_plan_is_the_cli_table test_gpu_check.py::test_run_ \
  test_properties.py::test_padding_never_leaks_on_real_ranks \
  test_launchers.py::test_init_distributed_reads_slurm_without_torchrun \
  test_train_data.py::test_stdlib_corpus_is_deterministic \
  test_train_hf_options.py::test_without_transformers_the_user_gets_one_line_with_the_install_command)

test-fast: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q --durations=10 $(FAST_SKIP) $(FAST_TESTS)

bench: $(STAMP)
	$(BIN)/shardwise bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# `make gpu-check`: every GPU test (tests/gpu) and `shardwise bench --device cuda` against
# FSDP2, on a machine with an NVIDIA GPU (docs/gpu.md). The setup (once: .venv-gpu with torch
# 2.13.0 from the default index, or python3's own CUDA torch where none can be fetched) is
# bounded by GPU_SETUP_S; the checks themselves by GPU_CHECK_S (under 8 minutes). Results go
# to $$OUT when set, else runs/gpu-check.
GPU_VENV ?= .venv-gpu
GPU_SETUP_S ?= 600
GPU_CHECK_S ?= 470

gpu-check:
	@command -v nvidia-smi >/dev/null 2>&1 || { echo "make gpu-check: no nvidia-smi on PATH," \
	  "so no NVIDIA GPU here: nothing was checked"; exit 2; }
	timeout -k 10 $(GPU_SETUP_S) $(PY) tests/gpu/check.py setup --venv $(GPU_VENV)
	timeout -k 10 $(GPU_CHECK_S) $(PY) tests/gpu/check.py run --venv $(GPU_VENV) \
	  --budget-s $$(( $(GPU_CHECK_S) - 20 ))
