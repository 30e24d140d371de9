# The two commands: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	touch $@

$(VENV)/.demo: $(VENV)/.created pyproject.toml constraints.txt
	$(PIP) -e ".[torch,cpu]"
	touch $@

$(VENV)/.dev: $(VENV)/.created pyproject.toml constraints.txt
	$(PIP) -e ".[dev]"
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(VENV)/bin/qkv demo

test: $(VENV)/.dev
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info
