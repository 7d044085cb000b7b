#!/usr/bin/env bash
# Prepares ComfyUI itself as the baseline of benchmarks/bench_comfy.py (--baseline comfyui), in the
# ignored folder .comfyui/ of the repository. ComfyUI is GPL-3.0: this script only extracts its
# source and downloads packages; none of ComfyUI's code is in the repository, nothing under
# .comfyui/ is ever committed, and the benchmark runs ComfyUI as its own process (its main.py).
#
# Step 0, a tool call (not a shell command): bring the source with the session's `fetch` tool,
#     fetch github:pollockjj/ComfyUI            -> /work/.mirror/pollockjj+ComfyUI/repo
# Upstream's snapshot (comfyanonymous/ComfyUI, its whole history) is over fetch's 500 MiB limit;
# that fork's HEAD 618b803 has upstream 3cd7b32f's tree unchanged (ComfyUI 0.8.0, 2026-01-07; the
# checkout tests/workflows/golden/ was made from). Comfy-Org/ComfyUI fetches too, but is older (2025-10).
#
# Then, from the repository root:
#     bash benchmarks/comfyui_baseline_setup.sh /work/.mirror/pollockjj+ComfyUI/repo [--cpu-site]
# writes
#   .comfyui/src      ComfyUI's HEAD tree (blobs the snapshot lacks, files of 4 MiB and more, are
#                     skipped: only the llama tokenizer.json, which FLUX does not use), without
#                     what the baseline never loads (tests, API nodes -- it runs with
#                     --disable-api-nodes --, tokenizers of other model families, .github): 8.4 MB
#                     to carry to the GPU machine
#   .comfyui/wheels   the wheels ComfyUI needs at start that the GPU image lacks (Python 3.12,
#                     manylinux x86-64): aiohttp and its dependencies, einops (3.1 MB)
#   .comfyui/stubs    an import-only stand-in for PyAV (`av`): ComfyUI imports it at start
#                     (comfy_api's video types), its wheel bundles FFmpeg (~36 MB) and does not fit
#                     the 64 MiB transfer, and the FLUX workflow reads and writes no video
# and with --cpu-site (a CPU machine such as the developers'):
#   .comfyui/site     ComfyUI's start-up requirements this venv lacks (pip --target), and an
#                     import-only torchvision stand-in: the registry's torchvision wheels are CUDA
#                     builds that need libtorch_cuda, which a CPU torch lacks; FLUX uses none of it.
#
# On the GPU machine (carry .comfyui/src, .comfyui/wheels, .comfyui/stubs):
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/comfyui_site .comfyui/wheels/*.whl
#     python3 benchmarks/bench_comfy.py --baseline comfyui --only flux --comfyui-site /tmp/comfyui_site:$PWD/.comfyui/stubs ...
# (benchmarks/PENDING_GPU.md has the row.)
set -euo pipefail

mirror=${1:?pass the git directory fetch gave, e.g. /work/.mirror/pollockjj+ComfyUI/repo}
cpu_site=${2:-}
root=$(git rev-parse --show-toplevel)
dest=$root/.comfyui
python=${PYTHON:-python3}

grep -qxE '/?\.comfyui/?' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null ||
  echo '/.comfyui/' >>"$(git rev-parse --git-common-dir)/info/exclude"

# -- the source: every blob of HEAD the snapshot holds, written file by file (git archive stops at
# the first missing blob), less what the baseline never loads
rm -rf "$dest/src"
mkdir -p "$dest/src"
skip='^(tests/|tests-unit/|\.github/|comfy_api_nodes/|comfy/text_encoders/(qwen25|hydit_clip|ace_lyrics|t5_pile|llama|byt5)_tokenizer/)'
git --git-dir="$mirror" ls-tree -r HEAD | while read -r _ type sha path; do
  [[ $type == blob ]] || continue
  [[ $path =~ $skip ]] && continue
  if ! git --git-dir="$mirror" cat-file -e "$sha" 2>/dev/null; then
    echo "skipped (not in the snapshot): $path" >&2
    continue
  fi
  mkdir -p "$dest/src/$(dirname "$path")"
  git --git-dir="$mirror" cat-file blob "$sha" >"$dest/src/$path"
done
# main.py imports comfy_api_nodes' package only when API nodes are on (--disable-api-nodes here)
echo "ComfyUI $(git --git-dir="$mirror" log -1 --format='%h %ad' --date=short HEAD): $(du -sh "$dest/src" | cut -f1)"

# -- the wheels the GPU image lacks (it has torch, torchvision, torchaudio, numpy, transformers,
# tokenizers, sentencepiece, safetensors, pyyaml, Pillow, scipy, tqdm, psutil; the project's
# .whl/ carries pydantic and torchsde). alembic / SQLAlchemy (its asset database), comfy-kitchen
# (fp8 / fp4 kernels), kornia, spandrel, pydantic-settings and the frontend / templates / docs
# packages only disable a feature when missing: not carried.
rm -rf "$dest/wheels"
$python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest/wheels" \
  aiohttp==3.14.5 yarl==1.25.1 multidict==7.2.1 propcache==0.5.4 frozenlist==1.8.0 aiosignal==1.4.0 \
  aiohappyeyeballs==2.7.1 attrs==26.1.0 einops==0.8.2
ls -l "$dest/wheels" | awk 'NR > 1 { printf "  %8.0f KB  %s\n", $5 / 1024, $9 }'
du -sh "$dest/wheels"

# -- the PyAV stand-in: enough for ComfyUI's module-level imports; any use raises
rm -rf "$dest/stubs"
mkdir -p "$dest/stubs/av/container" "$dest/stubs/av/subtitles"
cat >"$dest/stubs/av/__init__.py" <<'EOF'
"""Import-only stand-in for PyAV (bench_comfy.py's ComfyUI baseline): ComfyUI imports av at start;
the FLUX workflow never decodes or encodes media, so any use of it is an error."""


class _Missing:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("PyAV is not installed (an import-only stand-in): this workflow needs no video")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Missing,), {})


AudioFrame = VideoFrame = AudioStream = VideoStream = _Missing
time_base = 1000000


def open(*args, **kwargs):  # noqa: A001 - PyAV's name
    raise RuntimeError("PyAV is not installed (an import-only stand-in): this workflow needs no video")
EOF
cat >"$dest/stubs/av/container/__init__.py" <<'EOF'
from av import _Missing


class InputContainer(_Missing):
    pass


class OutputContainer(_Missing):
    pass


class Container(_Missing):
    pass
EOF
cat >"$dest/stubs/av/subtitles/__init__.py" <<'EOF'
EOF
cat >"$dest/stubs/av/subtitles/stream.py" <<'EOF'
from av import _Missing


class SubtitleStream(_Missing):
    pass
EOF

# -- a CPU machine: the start-up requirements this venv lacks, and the torchvision stand-in
if [[ $cpu_site == --cpu-site ]]; then
  rm -rf "$dest/site"
  $python -m pip install -q --no-deps --target "$dest/site" aiohttp yarl multidict propcache frozenlist aiosignal \
    aiohappyeyeballs attrs einops
  mkdir -p "$dest/site/torchvision/transforms"
  cat >"$dest/site/torchvision/__init__.py" <<'EOF'
"""Import-only stand-in for torchvision on a CPU machine (bench_comfy.py's ComfyUI baseline): the
registry's torchvision wheels are CUDA builds; ComfyUI imports torchvision at start, FLUX uses none of it."""
from . import transforms  # noqa: F401

__version__ = "0.0.0+stand-in"
EOF
  echo "from . import functional  # noqa: F401" >"$dest/site/torchvision/transforms/__init__.py"
  : >"$dest/site/torchvision/transforms/functional.py"
  echo "CPU site: $dest/site ($(du -sh "$dest/site" | cut -f1)); pass --comfyui-site $dest/site"
fi
