# Two commands on a fresh machine (Python 3.11): `make run` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/omskills: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -e '.[test,sam3,zoo,fleet]'
	# Huawei's auto_optimizer: its metadata pins onnxruntime<1.16; the API we use needs none of it.
	$(BIN)/pip install --no-deps ait-surgeon==0.1.1
	# Resemblyzer (a zoo model with trained weights): its own dependencies are in the zoo extra (see pyproject).
	$(BIN)/pip install --no-deps resemblyzer==0.1.4
	touch $@

install: $(BIN)/omskills

run: install bytecode  ## the main job: adapt SAM 3 (built-in task, full scale) end to end
	$(BIN)/omskills adapt task_records/sam3-video-text.yaml

test: install chromium bytecode  ## lint, format and import layers; the skill validation gate; the test suite (tiny SAM 3 on CPU)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/omskills validate
	$(BIN)/pytest -q

# Where PYTHONDONTWRITEBYTECODE is set (this machine image sets it), no process writes the .pyc of
# omskills' own modules, so each of the hundreds of processes a run or the tests start compiles
# them again (about 1 s each). Compiled once here; up-to-date files are skipped.
bytecode:
	$(BIN)/python -m compileall -q tools orchestrator skills

# Debian's chromium: a test renders report.html in it (headless). Installed when missing (CI runs
# as root); elsewhere a failed install only skips that test, with the reason.
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
	  || echo "chromium is not installed and apt-get could not install it: the report.html browser test will skip"

.PHONY: install run test chromium bytecode
