#!/usr/bin/env bash
# Build the ignored wheel folders a device call carries (benchmarks/PENDING_GPU.md): the device
# machine has Python 3.12, torch 2.11 and transformers, but none of the packages below, and it
# reaches no registry. A fresh checkout has none of these folders: run this once per session,
# here, before the first GPU call.
#   .whl/   diffusers 0.42.1 (the oracle and the baselines), the pydantic set (the request
#           plane), torchsde + trampoline (Stable Audio's Brownian noise), cache-dit (the
#           DBCache baseline): 'carry: [".whl"]', installed on the device with
#           python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   .whlc/  (--serve) the server stack for benchmarks that start `omniloop serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
get() {  # folder, requirement...: wheels for CPython 3.12 on manylinux x86_64, no dependencies
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$dir" "$@"
}
get .whl diffusers==0.42.1 pydantic==2.13.5 pydantic-core==2.46.5 annotated-types typing-inspection \
  typing-extensions==4.16.0 torchsde==0.2.6 trampoline==0.1.2 cache-dit==1.5.3
if [ "${1:-}" = "--serve" ]; then
  get .whlc fastapi starlette uvicorn h11 click anyio sniffio idna prometheus-client python-multipart \
    httpx httpcore certifi openai distro jiter websockets fastapi-offline
fi
du -sh .whl ${1:+.whlc} 2>/dev/null || true
