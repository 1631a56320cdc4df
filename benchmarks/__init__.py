"""Benchmarks of graph-transpiler against PyTorch (docs/benchmarks.md).

One command compares PyTorch eager with the project's runtime on the very modules ``models/``
exports (GPT-2-small 8x512 AdamW, ResNet-18 for 32x32 batch 256 SGD momentum, the perceptron
batch 1000 momentum), records JSON lines in benchmarks/results/<date>-<host>.jsonl and renders
docs/benchmarks.md (table + docs/images/benchmarks.png). From the repository root:

    # GPU host (onnxruntime-gpu in /tmp/site); two calls keep each under 10 minutes
    export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0
    python -m benchmarks prepare --work /tmp/bench-work       # export + transpile (CPU, parallel)
    python -m benchmarks compare --work /tmp/bench-work       # time every row, write JSONL + docs
    # or split into calls rendered as one run: --run-id ID --models gpt2_small, then --run-id ID --models ...

    # before/after of another checkout in the same session (rows LABEL[=FLAGS][@DIR])
    python -m benchmarks compare --work /tmp/bench-work --models gpt2_small --variants eager \
        --ours-variants 'default,allreduce,base@/path/to/old,basezero=--strategy zero@/path/to/old'

    # no GPU: torch on CPU and the CPU backend, tiny sizes
    python -m benchmarks compare --device cpu --models perceptron,gpt2_small,resnet18 --layers 2 \
        --width 64 --heads 2 --vocab 512 --seq 32 --batch 4 --cnn-width 8 --cnn-depth 1,1 \
        --image-size 16 --steps 2 --windows 3 --warmup 2 --work /tmp/bench-cpu

    python -m benchmarks render                    # docs again from benchmarks/results/*.jsonl (latest run)

The older one-purpose scripts stay: gpu_step_time.py (N-GPU strategies on the basic-op GPT),
gpu_diag.py and compare_export.py (used by the GPU tests), cpu_step_time.py.
"""
