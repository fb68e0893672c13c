#!/usr/bin/env bash
# `pip wheel .` and `pip install` of the wheel, as a user runs them in an environment that has torch: the build
# (PEP 517, scikit-build-core, with pip's build isolation) uses that torch and installs no second one; the wheel
# holds the Python package only; the installed package imports, preconditions a step, and names the torch it
# was built against.
#   tests/integration/pip_install_test.sh SOURCE_DIR PYTHON
set -euo pipefail
src="$1"
python="$2"
source "$(dirname "$0")/lib.sh"
scratch_dir

echo "== pip wheel (build isolation on)"
started=$(date +%s)
"$python" -m pip wheel "$src" --no-deps -w "$tmp/wheels" > "$tmp/wheel.log" 2>&1 || { tail -40 "$tmp/wheel.log"; fail "pip wheel"; }
echo "built in $(( $(date +%s) - started )) s"
if grep -Ei 'Collecting torch|Downloading torch|Installing collected packages:.*torch' "$tmp/wheel.log"; then
  fail "the isolated build pulled a torch"
fi
wheel=$(ls "$tmp"/wheels/dkfac-*.whl)
"$python" - "$wheel" <<'PY' || fail "wheel contents"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
print('\n'.join(sorted(names)))
assert any(n.startswith('dkfac/_C') and n.endswith('.so') for n in names), 'no extension'
for module in ('__init__.py', '_build_info.py', 'preconditioner.py', 'base_preconditioner.py'):
    assert f'dkfac/{module}' in names, module
assert not any(n.startswith(('include/', 'lib/', 'bin/')) or '.data/' in n for n in names), 'C++ files in the wheel'
PY

echo "== pip install of the wheel, then import and one step"
"$python" -m pip install --no-deps --target "$tmp/site" "$wheel" > "$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "pip install"; }
PYTHONPATH="$tmp/site" "$python" - "$tmp/site" <<'PY' || fail "the installed package"
import sys
import torch
import dkfac
from dkfac import _build_info
assert dkfac.__file__.startswith(sys.argv[1]), dkfac.__file__
assert _build_info.torch_version == torch.__version__, (_build_info.torch_version, torch.__version__)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
preconditioner = dkfac.KFACPreconditioner(model)
model(torch.randn(8, 4)).sum().backward()
plain = model[0].weight.grad.clone()
preconditioner.step()
assert not torch.equal(plain, model[0].weight.grad), 'the gradient was not preconditioned'
print('installed dkfac', dkfac.__version__, 'built against torch', _build_info.torch_version)
PY
echo "1 passed, 0 failed"
