"""Make docs/images/run-progress.svg: what `transpile run` shows on a terminal, from a real run.

    python3 docs/images/run_progress.py [WORKDIR]

Runs the README's quick start training (2 CPU ranks) under `script`, so that `transpile run` sees a
terminal and draws its rich progress bar, then keeps what stays on the screen at the end (the
banner, the bar's last frame, the summary) and renders it to SVG with rich.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.text import Text

SVG = Path(__file__).with_name("run-progress.svg")
WIDTH = 100


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="run-progress-"))
    py = shlex.quote(sys.executable)
    steps = [f"{py} -m models perceptron --rows 10000 -o {work}/perceptron",
             f"{py} -m commands {work}/perceptron/model.onnx --gpus 2 --optimizer momentum --momentum 0.9 --lr 0.0001 "
             f"-o {work}/out",
             f"cd {work} && stty cols {WIDTH} && {py} -m commands run out --data perceptron/data.npz --batch 16 "
             "--epochs 10 --log-every 625 --metrics metrics.jsonl --export trained.onnx"]
    for command in steps[:2]:
        subprocess.run(command, shell=True, check=True, capture_output=True)
    raw = subprocess.run(["script", "-q", "-c", steps[2], "/dev/null"], check=True, capture_output=True).stdout
    text = raw.decode().replace("\r\n", "\n")
    banner, rest = text.split("\x1b[?25l", 1)  # the bar hides the cursor when it starts
    frames, summary = rest.rsplit("\x1b[?25h", 1)[0], rest.rsplit("\x1b[?25h", 1)[1]
    last = re.split(r"(?:\x1b\[2K\x1b\[1A)+\x1b\[2K|\r", frames)[-1]
    screen = "$ transpile run out --data perceptron/data.npz --batch 16 --epochs 10 --log-every 625 " \
             "--metrics metrics.jsonl --export trained.onnx\n" + banner + last.rstrip("\n") + "\n" + summary
    screen = screen.replace(str(work.resolve()) + "/", "").replace(str(work) + "/", "")
    console = Console(record=True, width=WIDTH, force_terminal=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(Text.from_ansi(screen.strip("\n")), highlight=False)
    console.save_svg(str(SVG), title="transpile run")
    print(f"wrote {SVG}")


if __name__ == "__main__":
    main()
