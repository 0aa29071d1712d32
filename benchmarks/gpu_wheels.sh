#!/usr/bin/env bash
# Fetch, HERE (with internet), the wheels the GPU machine lacks into .whl/ (ignored by git, carried
# to the device with `carry: [".whl"]`; benchmarks/gpu_check.sh installs them into /tmp/site):
#   bash benchmarks/gpu_wheels.sh          # ~52 MB, about a minute; idempotent (pip skips what is there)
#   bash benchmarks/gpu_wheels.sh --smoke  # no network: checks the pin list (one version per package) and prints the plan
#
# The GPU machine (nvidia-h200, /work/.library/device/KINDS.md) has Python 3.12 at
# /opt/torch/.venv/bin/python3 with torch 2.11.0+cu130, nvcc 13.0, ninja, numpy, safetensors 0.8.0,
# accelerate, rich, pyyaml, fsspec, httpx, jinja2, pyarrow, matplotlib, pytest, ... but transformers
# 5.17, huggingface_hub 1.33 and tokenizers 0.23 (this project pins 4.57.6 / <1.0 / 0.22 and
# runs colossalai 0.5.0 with them), and no prefect, pydantic, colossalai, peft or galore. It reaches no registry.
# The list is this project's .venv (pyproject.toml + colossalai's runtime needs, prefect 3.9.1's
# closure) minus what that image already holds, at the exact versions the CPU tests run with, plus
# the pins the image gets wrong. tensorboardX (pure Python, 88 KB): the engine's per-step TensorBoard
# writer (tasks/engine/metrics.py), which without it only warns and writes nothing. typing-extensions and certifi are carried because pydantic 2.14
# and prefect 3.9 need releases newer than an image may hold.
#
# Not carried:
#   torch, nvidia-*, triton: the image's CUDA build is used (colossalai is installed --no-deps);
#   bitsandbytes (43 MB, over the 64 MiB a device call carries): only imported, never used, by
#     colossalai.nn.optimizer (GaLore 8-bit); gpu_check.sh writes an import-only stand-in;
#   colossalai's other declared deps (ray, fabric, diffusers, rpyc, ...): not imported on our paths.
# colossalai 0.5.0 and contexttimer 0.3.3 have no wheels on PyPI: they are built here from their
# sdists (pure Python; colossalai's CUDA kernels are JIT-built on the GPU machine from the sources
# the wheel ships).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; fi

# Binary and pure wheels, exact versions (cp312, manylinux x86_64).
WHEELS=(
  transformers==4.57.6 tokenizers==0.22.2 huggingface-hub==0.36.2 peft==0.21.2 galore-torch==1.0
  prefect==3.9.1 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3
  typing-extensions==4.16.0 typing-inspection==0.4.5 annotated-types==0.8.0 certifi==2026.10.19.post1
  aiosqlite==0.22.1 alembic==1.20.1 amplitude-analytics==1.3.0 apprise==2.0.1 asgi-lifespan==2.1.0
  asyncpg==0.32.0 beartype==0.23.1 burner-redis==0.1.7 cachetools==7.3.3 cffi==2.1.1 coolname==5.0.0
  cronsim==2.8 cryptography==50.0.2 cyclopts==5.5.2 dateparser==1.5.0 docker==7.2.0 docstring-parser==0.18.0
  exceptiongroup==1.3.2 fastapi==0.150.0 graphviz==0.21 greenlet==3.5.6 griffe==2.4.1 griffecli==2.4.1
  griffelib==2.4.1 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 jinja2-humanize-extension==0.4.0 jsonpatch==1.48
  jsonpointer==3.12 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 mako==1.4.3 oauthlib==4.0.1
  opentelemetry-api==1.45.2 orjson==3.13.0 pendulum==3.3.0 py-key-value-aio==0.5.0 pycparser==3.12
  pydocket==0.27.0 python-dotenv==1.2.4 python-json-logger==4.2.0 python-slugify==9.1.3 pytz==2026.6
  readchar==4.2.2 redis==8.1.0 referencing==0.37.0 requests-oauthlib==2.0.0 rfc3339-validator==0.1.4
  rich-rst==2.2.0 rpds-py==2026.9.1 ruamel-yaml==0.19.1 semver==3.1.2 sniffio==1.3.1 sqlalchemy==2.1.9
  starlette==1.10.0 text-unidecode==1.3 toml==0.10.2 tzdata==2026.6 tzlocal==5.4.5 uncalled-for==0.6.2
  uvicorn==0.54.0 websockets==16.1.1 whenever==0.11.0
  tensorboardX==2.6.5
)
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
if [ "$SMOKE" = 1 ]; then  # two pins of one package would make the device's install refuse both
  dups=$(printf '%s\n' "${WHEELS[@]}" | cut -d= -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
  echo "gpu_wheels --smoke: ${#WHEELS[@]} pinned wheels + colossalai, contexttimer (built from sdists), $(( ${#PLATFORMS[@]} / 2 )) platform tags; would fetch into $DEST (nothing fetched)"
  if [ -n "$dups" ]; then echo "gpu_wheels: pinned more than once: $dups" >&2; exit 1; fi
  exit 0
fi
mkdir -p "$DEST"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# This machine's pip config lists local indexes that may not exist; drop that noise, keep errors.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}" 2> >(grep -v "is ignored" >&2)

# Pure-Python sdists, built here into py3-none-any wheels (no kernels compiled: BUILD_EXT unset).
if ! ls "$DEST"/colossalai-0.5.0-*.whl >/dev/null 2>&1 || ! ls "$DEST"/contexttimer-0.3.3-*.whl >/dev/null 2>&1; then
  env -u BUILD_EXT "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DEST" colossalai==0.5.0 contexttimer==0.3.3 \
    2> >(grep -v "is ignored" >&2)
fi

n=$(ls "$DEST"/*.whl | wc -l)
size=$(du -sm "$DEST" | cut -f1)
echo "gpu_wheels: $n wheels, ${size} MB in $DEST (a device call carries at most 64 MiB with the working tree)"
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "gpu_wheels: more than one version of: $dups -- delete the extra ones (two versions stop the install)" >&2
  exit 1
fi
