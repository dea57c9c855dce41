#!/usr/bin/env bash
# Build and run kvserve's Docker images for real, with Debian's podman (and the buildah inside
# it): no Docker daemon and no registry, only apt and PyPI. Run as root from anywhere:
#   scripts/image-test.sh
#
# 1. Local stand-in bases, made once and reused: Debian (debootstrap, python3 + venv) for
#    python:3.11-slim-bookworm, and the same plus torch in the system Python for the CUDA
#    pytorch/pytorch base.
# 2. docker/Dockerfile.cpu built on the first (BASE_IMAGE build argument) and run: /ready 200,
#    the HEALTHCHECK passes, one chat completion, one structured output (json_schema: the content
#    parses and matches), and a SIGTERM drain (a stream in flight finishes, /ready turns 503,
#    the container exits 0).
# 3. docker/Dockerfile built on the second, every step of it (apt's gcc, install.sh,
#    `kvserve prepare`), then started on CPU (no GPU here) until /ready 200 and one completion.
# Each step prints "==> name" and ends with "PASS name (N s)" or "FAIL name: why"; the script
# exits non-zero on the first failure and removes the containers it started. The images stay
# (tagged kvserve:image-test-cpu and kvserve:image-test-gpu) so a rerun reuses their layers;
# the images they replace are removed.
#
# torch comes the way `pip install torch==<pin>` gets it on this host: the host's pip (its own
# index, find-links and CA settings) downloads the wheel and its dependencies into a small local
# index, mounted into the builds and passed as TORCH_INDEX_URL (it stands in for PyTorch's CPU
# index, which may be unreachable here). The host's CA bundle is mounted over the image's for
# pip's PyPI downloads (a TLS-intercepting proxy's CA, say).
#
# Environment (all optional):
#   IMAGE_TEST_CACHE          bases' root file systems and the torch index
#                             (default /var/tmp/kvserve-image-test)
#   IMAGE_TEST_MIRROR         Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   IMAGE_TEST_SUITE          Debian release of the bases (default bookworm: Python 3.11)
#   IMAGE_TEST_REBASE=1       make the bases again even if cached
#   IMAGE_TEST_NO_CACHE=1     build the kvserve images without podman's layer cache
#   IMAGE_TEST_GPU=0          skip step 3 (docker/Dockerfile)
#   IMAGE_TEST_PORT           host port of the running container (default 18000)
#   IMAGE_TEST_READY_S        how long to wait for /ready 200 (default 300)
#   IMAGE_TEST_GRACE_S        the CPU container's KVSERVE_SHUTDOWN_GRACE_S (default 120: room for
#                             the drain's 48-token stream on a slow, shared machine)
#   IMAGE_TEST_CA_BUNDLE      CA bundle mounted into builds (default /etc/ssl/certs/ca-certificates.crt;
#                             empty: none)
#   IMAGE_TEST_RUNTIME        OCI runtime (default runc)
#   IMAGE_TEST_STORAGE        podman storage driver (default: podman's own, overlay; vfs where
#                             overlay is impossible; switching needs an empty /var/lib/containers)
set -euo pipefail
cd "$(dirname "$0")/.."

cache=${IMAGE_TEST_CACHE:-/var/tmp/kvserve-image-test}
mirror=${IMAGE_TEST_MIRROR:-http://deb.debian.org/debian}
suite=${IMAGE_TEST_SUITE:-bookworm}
port=${IMAGE_TEST_PORT:-18000}
ready_s=${IMAGE_TEST_READY_S:-300}
grace_s=${IMAGE_TEST_GRACE_S:-120}
ca_bundle=${IMAGE_TEST_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
runtime=${IMAGE_TEST_RUNTIME:-runc}
# NOTE: explicit limits: podman's default (nofile 1048576) is above the hard limit of some hosts
# (20000 on the VM this was written on), where runc then fails with "error setting rlimits".
ulimits=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
packages=python3,python3-venv,python3-pip,ca-certificates,netbase
torch_version=$(grep -o 'torch==[0-9.]*' scripts/install.sh | head -1 | cut -d= -f3)
model=SmolLM2-135M-Instruct

pm() { podman --runtime "$runtime" ${IMAGE_TEST_STORAGE:+--storage-driver "$IMAGE_TEST_STORAGE"} "$@"; }
mounts=(-v "$cache/torch-index:/torch-index:ro")
[ -z "$ca_bundle" ] || mounts+=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
# --format docker: OCI image configs drop HEALTHCHECK, SHELL and STOPSIGNAL.
build_flags=(--format docker "${ulimits[@]}" "${mounts[@]}")
[ "${IMAGE_TEST_NO_CACHE:-0}" = 1 ] && build_flags+=(--no-cache)

# --- reporting and cleanup -----------------------------------------------------------------
summary=()
step_name="" step_t0=0
step() { step_name=$1; step_t0=$(date +%s); echo; echo "==> $step_name"; }
pass() {
  local took=$(($(date +%s) - step_t0))
  echo "PASS $step_name ($took s)${1:+: $1}"
  summary+=("$(printf '%-28s %5s s  %s' "$step_name" "$took" "${1:-}")")
}
fail() { echo "FAIL $step_name: $*" >&2; exit 1; }

containers=()
cleanup() {
  local status=$?
  for c in "${containers[@]}"; do
    if [ "$status" != 0 ]; then echo "--- last log lines of $c:" >&2; pm logs --tail 30 "$c" >&2 || true; fi
    pm rm -f -t 0 "$c" >/dev/null 2>&1 || true
  done
  [ "$status" = 0 ] || echo "image-test: FAILED (exit $status)" >&2
}
trap cleanup EXIT

# --- helpers -------------------------------------------------------------------------------
json() { python3 -c "import json, sys; d = json.load(sys.stdin); $1"; }

post() {  # post PATH BODY -> response body on stdout; fails on a non-200
  local out code
  out=$(mktemp)
  code=$(curl -sS -o "$out" -w '%{http_code}' --max-time 300 "http://127.0.0.1:$port$1" \
    -H 'Content-Type: application/json' -d "$2") || code=000
  cat "$out"; rm -f "$out"
  [ "$code" = 200 ] || { echo; echo "HTTP $code from $1" >&2; return 1; }
}

status_of() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$port$1" || true; }

build() {  # build TAG [podman build args...]; then drops the image TAG named before, with its layers
  local tag=$1 old
  shift
  old=$(pm image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
  pm build "${build_flags[@]}" -t "$tag" "$@" || return 1
  # NOTE: each change to the build context leaves ~2 GB of superseded layers otherwise.
  if [ -n "$old" ] && [ "$old" != "$(pm image inspect --format '{{.Id}}' "$tag")" ]; then
    pm rmi "$old" >/dev/null 2>&1 || true
  fi
}

image_size() { pm image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

start_container() {  # start_container NAME IMAGE [podman run flags...]; waits for /ready 200
  local name=$1 image=$2 t0 waited
  shift 2
  pm rm -f -t 0 "$name" >/dev/null 2>&1 || true
  containers+=("$name")
  t0=$(date +%s.%N)
  # NOTE: without systemd podman cannot schedule the HEALTHCHECK and says so at each start;
  # `podman healthcheck run` below still runs it.
  pm run -d --name "$name" "${ulimits[@]}" -p "127.0.0.1:$port:8000" "$@" "$image" \
    2> >(grep -v 'systemd connection' >&2) >/dev/null
  until [ "$(status_of /ready)" = 200 ]; do
    [ "$(pm inspect --format '{{.State.Running}}' "$name")" = true ] || fail "the container exited"
    waited=$(python3 -c "print(int($(date +%s.%N) - $t0))")
    [ "$waited" -lt "$ready_s" ] || fail "no /ready 200 within $ready_s s"
    sleep 0.5
  done
  ready_after=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
}

chat_check() {  # one greedy chat completion: non-empty content, usage counted
  local body reply
  body='{"model": "'$model'", "temperature": 0, "max_tokens": 32,
         "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  reply=$(post /v1/chat/completions "$body") || fail "chat completion: $reply"
  echo "$reply" | json '
c = d["choices"][0]
assert c["message"]["content"].strip(), d
assert c["finish_reason"] in ("stop", "length"), d
assert d["usage"]["completion_tokens"] > 0, d
print("reply:", repr(c["message"]["content"][:80]), d["usage"])' || fail "unexpected chat completion: $reply"
}

# --- 0. prerequisites ----------------------------------------------------------------------
step prerequisites
missing=()
for tool in podman "$runtime" curl python3; do command -v "$tool" >/dev/null || missing+=("$tool"); done
[ ${#missing[@]} = 0 ] || fail "missing ${missing[*]} (apt-get update && apt-get install podman buildah debootstrap runc)"
[ "$(id -u)" = 0 ] || fail "run as root (debootstrap and podman's root storage)"
[ -n "$torch_version" ] || fail "no torch==<version> pin found in scripts/install.sh"
[ -z "$ca_bundle" ] || [ -f "$ca_bundle" ] || fail "IMAGE_TEST_CA_BUNDLE=$ca_bundle does not exist"
mkdir -p "$cache"
pass "$(podman --version), $($runtime --version | head -1), storage $(pm info --format '{{.Store.GraphDriverName}}')"

# --- 1. the stand-in bases -----------------------------------------------------------------
# A recipe change (suite, packages, torch) gives new tags, so a stale cache is never reused.
recipe=$(echo "$suite $mirror $packages" | sha256sum | cut -c1-10)
debian_base=localhost/kvserve-standin/debian:$suite-$recipe
torch_base=localhost/kvserve-standin/torch:$torch_version-$suite-$recipe
rootfs_tar=$cache/debian-$suite-$recipe.tar

step debian-base
if [ "${IMAGE_TEST_REBASE:-0}" = 1 ]; then
  pm rmi -f "$torch_base" "$debian_base" >/dev/null 2>&1 || true
  rm -f "$rootfs_tar"
fi
if pm image exists "$debian_base"; then
  pass "cached $debian_base"
else
  if [ ! -f "$rootfs_tar" ]; then
    command -v debootstrap >/dev/null || fail "debootstrap is missing (apt-get install debootstrap)"
    rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
    echo "debootstrap $suite ($packages) from $mirror"
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" \
      >"$cache/debootstrap.log" 2>&1 || { tail -20 "$cache/debootstrap.log"; rm -rf "$rootfs"; fail "debootstrap failed"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$rootfs_tar.part" . && mv "$rootfs_tar.part" "$rootfs_tar"
    rm -rf "$rootfs"
  fi
  # NOTE: an imported tarball has no config: PATH must be set, or the Dockerfiles'
  # PATH=/opt/venv/bin:$PATH would lose /usr/bin.
  pm import --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV=LANG=C.UTF-8' --change 'CMD=["/bin/bash"]' "$rootfs_tar" "$debian_base" >/dev/null
  pass "$debian_base from debootstrap ($(image_size "$debian_base"))"
fi

step torch-index
# The wheels the host's pip picks for torch==<pin> and its dependencies (for the image's
# Python 3.11), as a PEP 503 index.
index=$cache/torch-index
if [ ! -f "$index/simple/torch/index.html" ] || ! ls "$index/files/torch-$torch_version"[-+]*.whl >/dev/null 2>&1; then
  rm -rf "$index" && mkdir -p "$index/files"
  python3 -m pip download --quiet --dest "$index/files" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "torch==$torch_version" \
    || fail "pip download torch==$torch_version failed"
  python3 - "$index" <<'EOF'
import pathlib, re, sys
index = pathlib.Path(sys.argv[1])
for wheel in sorted((index / "files").glob("*.whl")):
    project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    page = index / "simple" / project / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    with page.open("a") as f:
        f.write(f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')
EOF
fi
pass "$(ls "$index/files" | grep -c whl) wheels, $(ls "$index/files" | grep '^torch-')"

# --- 2. docker/Dockerfile.cpu --------------------------------------------------------------
step build-cpu
build kvserve:image-test-cpu -f docker/Dockerfile.cpu \
  --build-arg BASE_IMAGE="$debian_base" --build-arg TORCH_VERSION="$torch_version" \
  --build-arg TORCH_INDEX_URL=file:///torch-index/simple . || fail "podman build -f docker/Dockerfile.cpu"
cpu_size=$(image_size kvserve:image-test-cpu)
pass "kvserve:image-test-cpu, $cpu_size"

step ready-cpu
cpu=kvserve-image-test-cpu-$$
start_container "$cpu" kvserve:image-test-cpu -e KVSERVE_SHUTDOWN_GRACE_S="$grace_s"
[ "$(status_of /health)" = 200 ] || fail "/health is not 200"
pm healthcheck run "$cpu" >/dev/null || fail "the image's HEALTHCHECK fails while /ready is 200"
pass "/ready 200 after $ready_after s, HEALTHCHECK passes"

step chat-cpu
chat_check
pass

step structured-cpu
schema='{"type": "object", "additionalProperties": false, "required": ["city", "population"],
         "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer"}}}'
reply=$(post /v1/chat/completions '{"model": "'$model'", "temperature": 0, "max_tokens": 64,
  "messages": [{"role": "user", "content": "Give the largest city of France and its population as JSON."}],
  "response_format": {"type": "json_schema", "json_schema": {"name": "city", "strict": true, "schema": '"$schema"'}}}') \
  || fail "structured output: $reply"
echo "$reply" | json '
c = d["choices"][0]
assert c["finish_reason"] == "stop", ("the JSON did not close within max_tokens", d)
out = json.loads(c["message"]["content"])
assert set(out) == {"city", "population"}, out
assert isinstance(out["city"], str) and len(out["city"]) <= 40, out
assert isinstance(out["population"], int) and not isinstance(out["population"], bool), out
print("content:", json.dumps(out))' || fail "the content does not match the schema: $reply"
pass

step drain-cpu
# A stream in flight when SIGTERM arrives runs to its end; meanwhile /ready answers 503; then
# the process exits 0 on its own, before the grace is over (podman stop's SIGKILL comes later).
stream=$(mktemp)
chunks() { grep -c '"content": *"[^"]' "$stream" || true; }
curl -sS -N --max-time $((grace_s + 60)) "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "'$model'", "stream": true, "temperature": 0, "max_tokens": 48,
       "messages": [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]}' >"$stream" &
curl_pid=$!
for _ in $(seq 1200); do
  [ "$(chunks)" -ge 3 ] && break
  kill -0 "$curl_pid" 2>/dev/null || break
  sleep 0.1
done
before=$(chunks)
[ "$before" -ge 3 ] || fail "the stream did not start: $(tail -c 600 "$stream")"
stop_t0=$(date +%s.%N)
pm stop -t $((grace_s + 30)) "$cpu" >/dev/null &
stop_pid=$!
sleep 0.5
ready_draining=$(status_of /ready)
wait "$curl_pid" || fail "the stream broke off: $(tail -c 600 "$stream")"
after=$(chunks)
last=$(tr -d '\r' <"$stream" | grep -v '^$' | tail -1)
finish=$(grep -c '"finish_reason": *"\(stop\|length\)"' "$stream" || true)
rm -f "$stream"
wait "$stop_pid" || fail "podman stop failed"
stop_s=$(python3 -c "print(f'{$(date +%s.%N) - $stop_t0:.1f}')")
code=$(pm inspect --format '{{.State.ExitCode}}' "$cpu")
[ "$last" = "data: [DONE]" ] || fail "the stream did not end with [DONE]: $last"
[ "$after" -gt "$before" ] || fail "no tokens after SIGTERM ($before before, $after after)"
[ "$finish" -ge 1 ] || fail "no chunk with finish_reason stop or length: the stream was cut"
[ "$ready_draining" = 503 ] || fail "/ready answered $ready_draining while draining, not 503"
[ "$code" = 0 ] || fail "the container exited $code, not 0"
pm logs "$cpu" 2>&1 | grep -q "drained: no request in flight" || fail "no 'drained' line in the log"
pass "$before chunks before SIGTERM, $after at [DONE], /ready 503 while draining, exit 0 after $stop_s s"

# --- 3. docker/Dockerfile on a base with torch standing in for the CUDA base ---------------
if [ "${IMAGE_TEST_GPU:-1}" != 0 ]; then
  step torch-base
  if pm image exists "$torch_base"; then
    pass "cached $torch_base"
  else
    # pytorch/pytorch has torch importable by python3 outside any venv: here the system Python's.
    context=$(mktemp -d)
    printf '%s\n' "FROM $debian_base" \
      "RUN python3 -m pip install --no-cache-dir --break-system-packages --index-url file:///torch-index/simple torch==$torch_version" \
      >"$context/Containerfile"
    pm build "${build_flags[@]}" -t "$torch_base" "$context" || fail "building $torch_base"
    rm -rf "$context"
    pass "$torch_base ($(image_size "$torch_base"))"
  fi

  step build-gpu
  build kvserve:image-test-gpu -f docker/Dockerfile \
    --build-arg BASE_IMAGE="$torch_base" . || fail "podman build -f docker/Dockerfile"
  gpu_size=$(image_size kvserve:image-test-gpu)
  pass "kvserve:image-test-gpu, $gpu_size (every step ran, kvserve prepare included)"

  step ready-gpu-image-on-cpu
  gpu=kvserve-image-test-gpu-$$
  start_container "$gpu" kvserve:image-test-gpu -e KVSERVE_DEVICE=cpu
  chat_check
  pm stop -t 60 "$gpu" >/dev/null
  code=$(pm inspect --format '{{.State.ExitCode}}' "$gpu")
  [ "$code" = 0 ] || fail "the container exited $code, not 0"
  pass "/ready 200 after $ready_after s, one chat completion, exit 0"
fi

echo
echo "==> summary"
printf '%s\n' "${summary[@]}"
echo "image-test: all checks passed"
