"""edgec command line: parse, call one function, print. No logic lives here."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from edgec.errors import EdgecError, one_line

try:
    import click
except ModuleNotFoundError as missing:  # a runtime-only install (pip install 'edgec[runtime]') has no click
    print(
        f"error: the edgec command needs {missing.name}, which comes with the compiler: pip install 'edgec[build]' "
        '(a runtime-only machine runs bundles with: python -m edgec.runtime BUNDLE "PROMPT")',
        file=sys.stderr,
    )
    raise SystemExit(2) from None

# what the compiler's commands import beyond the runtime (the build extra): missing, they are named, not traced
BUILD_MODULES = (
    "rich",
    "torch",
    "transformers",
    "onnx",
    "onnx_ir",
    "onnxscript",
    "gguf",
    "accelerate",
    "safetensors",
    "sentencepiece",
    "jinja2",
    "ml_dtypes",
    "cryptography",
)

from edgec.evaluate import METRICS as EVAL_METRICS  # noqa: E402  (numpy only)
from edgec.kvcache.compression import Compression  # noqa: E402  (numpy only; after the click check)


class _Group(click.Group):
    """Turns any EdgecError, any bad option or argument, and a build-only module missing from a runtime-only
    install into one line on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EdgecError as error:
            click.echo(f"error: {one_line(error, 2000)}", err=True)
            sys.exit(2)
        except ModuleNotFoundError as missing:
            if (missing.name or "").split(".")[0] not in BUILD_MODULES:
                raise
            command = ctx.invoked_subcommand or "this command"
            click.echo(
                f"error: edgec {command} needs {missing.name}, which comes with the compiler: "
                "pip install 'edgec[build]'",
                err=True,
            )
            sys.exit(2)
        except click.UsageError as error:
            command = f" (see edgec {error.ctx.info_name} --help)" if error.ctx is not None else ""
            click.echo(f"error: {one_line(error.format_message(), 2000)}{command}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="edgec")
def main() -> None:
    """Compile a decoder-only language model into a bundle that runs offline on one target."""


# the compressed cache's options come from its settings type: flag, help, choices and default are declared once
def kv_options(command=None, *, at_load: bool = False):
    """Add one option per compressed-cache setting that has a flag (``Compression``'s fields); ``at_load``: only
    those a built bundle may change (for ``edgec run``), defaulting to the bundle's."""

    def add(command):
        for _, default, option in reversed(Compression.options()):
            if option.flag is None or (at_load and not option.at_load):
                continue
            choices = option.allowed()
            kind = click.Choice(choices) if choices else (type(default) if default is not None else int)
            shown = "[the bundle's]" if at_load else f"[default: {option.default_text or default}]"
            command = click.option(
                option.flag, type=kind, default=None, help=f"Compressed cache: {option.help} {shown}"
            )(command)
        return command

    return add(command) if command is not None else add


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--target", "-t", default="cpu", show_default=True, help="Target name (see targets/).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Bundle folder to write.")
@click.option("--context", type=int, default=None, help="Cache capacity in tokens [default: the model's maximum].")
@click.option("--prefill-chunk", type=int, default=None, help="Prompt tokens per prefill step [default: target's].")
@click.option(
    "--weights",
    type=click.Choice(["fp32", "fp16", "fp8", "int8", "int4"]),
    default=None,
    help="Weight format [default: the target's].",
)
@click.option(
    "--block-size",
    type=click.Choice(["32", "64", "128"]),
    default="32",
    show_default=True,
    help="int4: input channels per scale.",
)
@click.option("--symmetric", is_flag=True, help="int4: no zero point.")
@click.option(
    "--accuracy-level",
    type=click.IntRange(0, 4),
    default=4,
    show_default=True,
    help="int4 on ONNX Runtime: 4 = int8 activations (fast), 1 = fp32 activations (exact).",
)
@click.option(
    "--split-activations/--no-split-activations",
    default=None,
    help="int4/int8 at level 2-4: each int8 activation as two rows, its int8 rounding and the rest "
    "(near fp32's answers at ~0.6-0.8x one row's speed) [default: on for a GGUF's own blocks, else off].",
)
@kv_options
@click.option(
    "--kv-plugin",
    type=click.Choice(["on", "off"]),
    default="off",
    show_default=True,
    help="TensorRT-RTX targets with a compressed cache: its one-token step as a plugin running a Triton kernel "
    "(docs/plugins.md); off = standard ops only.",
)
@click.option("--protect", default=None, help="Default protected tokens at run time: numbers,names.")
@click.option(
    "--embedding-bits",
    type=int,
    default=8,
    show_default=True,
    help="int4: bits of the embedding table (shared with a tied lm_head): 8 (exact for GGUF Q8_0) or 4 (smaller).",
)
@click.option(
    "--quant-method",
    default="rtn",
    show_default=True,
    help="int4: rtn (round to nearest), awq (activation-aware scaling) or gptq (error feedback); awq and gptq "
    "calibrate on text, a few minutes on CPU for 135M.",
)
@click.option("--calib", default=None, help="awq/gptq: calibration text file [default: Python's pydoc_data.topics].")
@click.option(
    "--int4-form",
    default=None,
    help="int4: matmulnbits (ONNX Runtime's kernel) or qdq (standard DequantizeLinear + MatMul) [default: target's].",
)
@click.option(
    "--memory",
    default=None,
    help="The device's memory (6GB, 8GiB) for the fit check, in place of the target's (as edgec plan --memory).",
)
@click.option("--allow-pickle", is_flag=True, help="Accept pickle (*.bin) weights; pickle can run arbitrary code.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle (or empty folder) at -o.")
@click.option(
    "--sign",
    "sign_key",
    type=click.Path(path_type=Path),
    default=None,
    help="Sign the bundle with this private key (edgec keygen); loaders check it with the public key.",
)
def build(
    model,
    target,
    output,
    context,
    prefill_chunk,
    weights,
    block_size,
    symmetric,
    accuracy_level,
    split_activations,
    kv_plugin,
    protect,
    embedding_bits,
    quant_method,
    calib,
    int4_form,
    memory,
    allow_pickle,
    overwrite,
    sign_key,
    **kv_flags,
) -> None:
    """Build a bundle from a Hugging Face folder or a .gguf file.

    \b
    Example:
      edgec build ./SmolLM2-135M-Instruct.Q4_1.gguf --target cpu -o smol.cpu.edgec --context 4096
      edgec build ./SmolLM2-135M-Instruct.Q4_1.gguf -o smol.cpu.edgec --sign release.key
    """
    from edgec.build import BuildSettings
    from edgec.build import build as run_build
    from edgec.load import quiet_progress_environment
    from edgec.plan import parse_memory

    quiet_progress_environment()  # before transformers and tqdm are imported; edgec shows its own progress

    settings = BuildSettings(
        target=target,
        context=context,
        prefill_chunk=prefill_chunk,
        weights=weights,
        block_size=int(block_size),
        symmetric=symmetric,
        accuracy_level=accuracy_level,
        split_activations=split_activations,
        kv=Compression.from_flags({Compression.parameters()[key]: value for key, value in kv_flags.items()}),
        kv_plugin=kv_plugin == "on",
        protect=protect,
        embedding_bits=embedding_bits,
        quant_method=quant_method,
        calib=calib,
        int4_form=int4_form,
        allow_pickle=allow_pickle,
        overwrite=overwrite,
        memory=parse_memory(memory) if memory is not None else None,
    )
    key = seal = None
    if sign_key is not None:  # read the key before the build: a wrong passphrase should not cost a build
        from edgec.signing import load_signing_key, sign_bundle

        key = load_signing_key(sign_key)

        def seal(folder: Path) -> None:
            sign_bundle(folder, key)

    from rich.console import Console

    if Console().is_terminal:
        result = _build_with_bars(model, output, settings, seal)
    else:  # a log file or a pipe: one plain line per stage (a live bar would be \r-joined noise there)
        result = run_build(model, output, settings, progress=plain_progress(), seal=seal)
    validation = result.manifest["validation"]
    click.echo(
        f"wrote {output} (against the source model: top-1 agreement {validation['top1_agreement']:.0%}, "
        f"max |Δlogit| {validation['max_abs_logit_error']:.2e})" + (f", signed by key {key.key_id}" if key else "")
    )
    if blocks := result.manifest["build_settings"].get("gguf_blocks"):
        recorded = result.manifest["build_settings"]
        level = recorded.get("accuracy_level", 4)
        if level <= 1:
            activations = "fp32 activations: exact"
        elif recorded.get("split_activations"):
            activations = "int8 activations split in two rows: near exact; --no-split-activations is faster"
        else:
            activations = f"int8 activations at accuracy level {level}: answers may change; --split-activations"
        click.echo(
            f"int4: {blocks['carried_exactly']} of {blocks['weights']} weights keep the GGUF's own blocks "
            f"({activations})"
        )
    click.echo("time: " + ", ".join(f"{stage[:-2]} {seconds:.1f} s" for stage, seconds in result.timings.items()))


def _build_with_bars(model, output, settings, seal):
    """The build with rich progress bars (on a terminal): the stages, and a long stage's own steps."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from edgec.build import STAGES
    from edgec.build import build as run_build

    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("starting", total=len(STAGES))

        steps: dict[str, int] = {}

        def advance(stage: str, done: int | None = None, total: int | None = None) -> None:
            if done is None:  # a stage starts
                progress.update(task, description=stage, completed=STAGES.index(stage))
                return
            if stage not in steps:  # a long stage's own bar (GPTQ: one step per layer)
                steps[stage] = progress.add_task(stage, total=total)
            progress.update(steps[stage], completed=done, total=total)

        result = run_build(model, output, settings, progress=advance, seal=seal)
        progress.update(task, description="done", completed=len(STAGES))
    return result


def plain_progress(echo=None):
    """A build progress callback that writes plain lines (for logs): each stage as it starts, and a long stage's
    steps at every tenth of the way, each with the seconds since the build started."""
    import time

    from edgec.build import STAGES

    echo = echo or click.echo
    started = time.monotonic()
    step = tenth_lines(echo, started)
    echo(f"[{0:7.1f} s] starting (checking the settings against the model's config and the target)")

    def advance(stage: str, done: int | None = None, total: int | None = None) -> None:
        if done is None:
            echo(f"[{time.monotonic() - started:7.1f} s] {stage} ({STAGES.index(stage) + 1}/{len(STAGES)})")
            return
        step(stage, done, total)

    return advance


def tenth_lines(echo, started: float):
    """A ``(task, done, total)`` callback writing one plain line per tenth of each task (its start and its end
    included), with the seconds since ``started``."""
    import time

    shown: dict[str, int] = {}

    def line(task: str, done: int, total: int | None) -> None:
        tenth = 10 * done // total if total else 0
        if shown.get(task) != tenth:
            shown[task] = tenth
            echo(f"[{time.monotonic() - started:7.1f} s] {one_line(task)} {done}/{total or '?'}")

    return line


@main.command()
def targets() -> None:
    """List the targets (one TOML file each in targets/).

    \b
    Example:
      edgec targets
    """
    from rich.table import Column, Table

    from edgec.targets import available_targets, load_target

    table = Table("device", "runtime", "sm", "memory", "usable", "dtypes", "build")
    table.columns.insert(0, Column("target", no_wrap=True))
    for name in available_targets():
        t = load_target(name)
        table.add_row(
            name,
            t.device,
            t.runtime,
            t.compute_capability or "",
            f"{t.memory_bytes / 2**30:.0f} GiB",
            f"{t.usable_bytes / 2**30:.1f} GiB",
            ",".join(t.dtypes),
            "yes" if t.buildable else "plan",
        )
    plain_console().print(table)


@main.command()
@click.argument("model")
@click.option("--target", "-t", default="cpu", show_default=True)
@click.option("--context", type=int, default=None, help="Context in tokens [default: the model's maximum].")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8", "int4"]), default=None)
@click.option("--kv", type=click.Choice(["fp32", "fp16", "fp8", "int8", "int4"]), default=None)
@click.option("--prefill-chunk", type=int, default=None)
@click.option(
    "--kv-mixed",
    type=click.Choice(["none", "int8", "fp16"]),
    default="none",
    help="The sinks and recent window (sink + window slots per head) in this wider storage (edgec build --kv-mixed).",
)
@click.option(
    "--prefill-compress",
    type=click.Choice(["end", "chunk"]),
    default=None,
    help="How a prompt longer than a compressed cache's capacity is read (edgec build --prefill-compress): end "
    "reads it whole first (its temporary state counts), chunk compresses as it reads [default: end, conceded to "
    "chunk with fewer slots].",
)
@click.option(
    "--memory",
    default=None,
    help="The device's memory (6GB, 8GiB, 512MiB) in place of the target's; the target's usable share and "
    "runtime overhead still apply.",
)
def plan(model, target, context, weights, kv, prefill_chunk, kv_mixed, prefill_compress, memory) -> None:
    """Will MODEL fit TARGET, and with which settings? Needs only a config (no weights). Ends with the
    `edgec build` line that builds the plan.

    MODEL is a model folder, a config.json, a .gguf, or a bundled config name (llama-2-7b, llama-3-8b,
    smollm2-135m). Settings you give are kept; the others are conceded in order until the plan fits.

    \b
    Example:
      edgec plan llama-3-8b --target rtx3060-laptop --context 16384
      edgec plan ./SmolLM2-135M-Instruct.Q4_1.gguf --target cpu --memory 2GB
    """
    from rich.table import Table

    from edgec.plan import build_command, parse_memory, with_memory
    from edgec.plan import plan as make_plan

    memory_bytes = parse_memory(memory) if memory is not None else None
    shape, chosen = _plan_inputs(model, target, context, weights, kv, prefill_chunk, kv_mixed, prefill_compress)
    estimate = make_plan(shape, with_memory(chosen[0], memory_bytes), chosen[1], fixed=chosen[2])
    table = Table("", "", title=f"{shape.name} on {estimate.target.name}: fits")
    for key, value in estimate.table():
        table.add_row(key, value)
    console = plain_console()
    console.print(table)
    console.print(f"settings: {estimate.settings.describe()}")
    console.print(f"concessions made: {', '.join(estimate.concessions) or 'none'}")
    if shape.max_context and estimate.settings.context > shape.max_context:
        console.print(
            f"note: context {estimate.settings.context} is beyond the {shape.max_context} tokens "
            f"{shape.name} was trained for"
        )
    console.print("build it with:")
    click.echo(build_command(model, estimate, memory))  # one unwrapped line, to copy


def plain_console():
    """A rich Console that never truncates or wraps tables to 80 columns when output goes to a file or a pipe
    (rich's width when it cannot ask a terminal)."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=10_000)
    return console


def _plan_inputs(model, target_name, context, weights, kv, prefill_chunk, kv_mixed="none", prefill_compress=None):
    from edgec.build import MIXED_TARGETS
    from edgec.errors import BuildSettingsError
    from edgec.kvcache.quantize import bytes_per_value
    from edgec.plan import Settings, model_shape
    from edgec.targets import load_target

    target = load_target(target_name)
    shape = model_shape(model)
    for name, value in (("weights", weights), ("kv", kv)):
        if value is not None and value not in target.dtypes:
            raise BuildSettingsError(f"{target.name} has no {value} ({name}); it has {', '.join(target.dtypes)}")
    if context is not None and context < 1:
        raise BuildSettingsError(f"--context must be a positive number of tokens, got {context}")
    settings = Settings(
        weights=weights or target.defaults.get("weights", "fp32"),
        kv=kv or target.defaults.get("kv", "fp32"),
        context=context or shape.max_context or 4096,
        prefill_chunk=prefill_chunk or int(target.defaults.get("prefill_chunk", 512)),
        kv_mixed=kv_mixed,
        prefill_compress=prefill_compress or Settings.prefill_compress,
        # quantized products split their activations (and so get a prompt-chunk graph) by default only for a
        # GGUF's own blocks; from a folder, a config or a bundled name they do not
        split_activations=str(model).lower().endswith(".gguf"),
    )
    narrower = kv is not None and kv_mixed != "none" and bytes_per_value(kv_mixed, 32) > bytes_per_value(kv, 32)
    if kv_mixed != "none" and (target.name not in MIXED_TARGETS or not narrower):
        raise BuildSettingsError(
            f"--kv-mixed {kv_mixed} plans the ONNX Runtime CPU targets ({', '.join(MIXED_TARGETS)}) with a narrower "
            f"--kv given (int4 under int8; int4/int8/fp8 under fp16); got {target.name}, --kv {kv}"
        )
    given = (("weights", weights), ("kv", kv), ("prefill_chunk", prefill_chunk), ("prefill_compress", prefill_compress))
    fixed = frozenset(name for name, value in given if value)
    return shape, (target, settings, fixed)


def generation_options(command):
    """Options shared by ``run`` and ``chat``: sampling, stop strings, repetition penalty, a chat template."""
    options = [
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=int, default=0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=None),
        click.option("--stop", "stops", multiple=True, help="End the answer where this text appears (repeatable)."),
        click.option(
            "--repeat-penalty",
            type=float,
            default=1.0,
            show_default=True,
            help="> 1 makes tokens already in the prompt or answer less likely (1 = off).",
        ),
        click.option(
            "--chat-template",
            type=click.Path(path_type=Path),
            default=None,
            help="Jinja chat template file (or a tokenizer_config.json holding one) in place of the bundle's; "
            "gives a base model's bundle a chat format.",
        ),
        click.option(
            "--trust", multiple=True, type=click.Path(path_type=Path), help="Run only if signed by this public key."
        ),
        click.option(
            "--threads", type=click.IntRange(1), default=None, help="ONNX Runtime threads [default: calibrated]."
        ),
        click.option(
            "--calibrate/--no-calibrate",
            default=True,
            show_default=True,
            help="Measure threads and spinning for this bundle on this machine once (stored in ~/.cache/edgec); "
            "--no-calibrate: use a stored calibration only, else ONNX Runtime's defaults.",
        ),
        kv_options(at_load=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _check_repeat_penalty(value: float) -> None:
    import math

    if not (math.isfinite(value) and value > 0):
        raise click.UsageError(f"--repeat-penalty must be a number > 0 (1 = off), got {value}")


def _load_for_generation(bundle: Path, trust, chat_template: Path | None, kv_flags: dict):
    """The bundle loaded for ``run`` / ``chat``, with ``--chat-template`` applied (the file is read before the
    bundle loads, so a bad path fails at once)."""
    from edgec.runtime import Model

    template = None
    if chat_template is not None:
        from edgec.chat_template import read_chat_template

        template = read_chat_template(chat_template)
    model = Model.load(bundle, trust=list(trust) or None, **kv_flags)
    if template is not None:
        from edgec.chat_template import chat_format_from_template

        model.set_chat_format(chat_format_from_template(template, **model.special_tokens()))
    return model


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from the argument, stdin (``-``) or ``--prompt-file``; one trailing newline (what echo and
    editors add) is dropped."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
            raise click.UsageError(f"cannot read --prompt-file {prompt_file}: {reason}") from None
        source = f"--prompt-file {prompt_file}"
    elif prompt == "-":
        text, source = sys.stdin.read(), "stdin"
    elif prompt is None:
        raise click.UsageError("give a PROMPT, - to read it from stdin, or --prompt-file FILE")
    else:
        text, source = prompt, "the prompt"
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise click.UsageError(f"the prompt is empty ({source})")
    return text


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None, help="Read the prompt from a file.")
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat format (implied by --chat-template).")
@click.option("--protect", default=None, help="Compressed cache: never evict these prompt tokens (numbers,names).")
@click.option("--quiet", "-q", is_flag=True, help="No speed line on stderr.")
@click.option(
    "--prefix-cache",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Folder of saved prompts: the longest saved one this prompt starts with is restored instead of read "
    "again, and this prompt's cache state is saved there.",
)
@generation_options
def run(
    bundle,
    prompt,
    prompt_file,
    max_new_tokens,
    chat,
    protect,
    quiet,
    prefix_cache,
    temperature,
    top_k,
    top_p,
    seed,
    stops,
    repeat_penalty,
    chat_template,
    trust,
    **kv_flags,
) -> None:
    """Generate text from a bundle, streaming to the terminal; then one line on stderr: prompt and decode
    tokens/s and the time to the first token. PROMPT - reads the prompt from stdin.

    \b
    Example:
      edgec run smol.cpu.edgec "Explain KV caches in one sentence." --chat
      echo "Once upon a time" | edgec run gemma.cpu.edgec - -n 64 --repeat-penalty 1.1 --stop "The End"
      edgec run gemma.cpu.edgec "Hi!" --chat-template chatml.jinja
      edgec run smol.cpu.edgec "Hello" --trust release.pub
      edgec run smol.cpu.edgec --prompt-file report.txt --prefix-cache ~/.cache/edgec-prompts
    """
    from edgec.runtime import GenerationStats

    _check_repeat_penalty(repeat_penalty)
    text = _read_prompt(prompt, prompt_file)
    model = _load_for_generation(bundle, trust, chat_template, kv_flags)
    stats = GenerationStats()
    pieces = model.generate(
        text,
        protect=protect,
        chat=chat or chat_template is not None,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=list(stops),
        repeat_penalty=repeat_penalty,
        stats=stats,
        stream=True,
        prefix_cache=prefix_cache,
    )
    for piece in pieces:
        click.echo(terminal_text(piece), nl=False)
    click.echo()
    if not quiet:
        click.echo(stats.line(), err=True)


CHAT_HELP = "/reset clears the conversation, /stats shows the last answer's speed, /exit or Ctrl-D quits"


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="System message that opens the conversation (kept by /reset).")
@click.option("--max-new-tokens", "-n", type=int, default=512, show_default=True, help="Per answer.")
@generation_options
def chat(
    bundle, system, max_new_tokens, temperature, top_k, top_p, seed, stops, repeat_penalty, chat_template, trust, **kv
) -> None:
    """Talk with a bundle: a multi-turn conversation in the model's chat format, answers streamed.

    In the conversation: /reset clears it, /stats shows the last answer's prompt and decode tokens/s and time
    to first token, /exit (or Ctrl-D) quits. Each turn reads the whole conversation again (a compressed cache
    chooses what to keep knowing the newest question).

    \b
    Example:
      edgec chat smol.cpu.edgec --system "Answer in one sentence." --repeat-penalty 1.1
      edgec chat gemma.cpu.edgec --chat-template chatml.jinja --stop "<end_of_turn>"
    """
    from edgec.errors import EdgecError, GenerationError
    from edgec.runtime import GenerationStats

    _check_repeat_penalty(repeat_penalty)
    model = _load_for_generation(bundle, trust, chat_template, kv)
    if model.tokenizer.chat_format is None:
        raise GenerationError(
            f"{bundle} has no chat format ({model.tokenizer.chat_note}); give one with --chat-template FILE"
        )
    opening = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []
    last: GenerationStats | None = None
    click.echo(f"chatting with {one_line(bundle)}; {CHAT_HELP}", err=True)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            history.clear()
            click.echo("(conversation cleared)", err=True)
            continue
        if command == "/stats":
            click.echo(last.line() if last else "(no answer yet)", err=True)
            continue
        if command.startswith("/") and " " not in command:
            click.echo(f"unknown command {one_line(command)}; {CHAT_HELP}", err=True)
            continue
        turn = [*history, {"role": "user", "content": line}]
        stats = GenerationStats()
        try:  # the prompt is checked (and may not fit the context) before any token is made
            pieces = model.generate(
                messages=opening + turn,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=list(stops),
                repeat_penalty=repeat_penalty,
                stats=stats,
                stream=True,
            )
        except EdgecError as error:  # the conversation is kept as it was: /reset, or ask something shorter
            click.echo(f"error: {one_line(error, 2000)}; /reset starts a new conversation", err=True)
            continue
        answer = []
        try:
            for piece in pieces:
                answer.append(piece)
                click.echo(terminal_text(piece), nl=False)
        except KeyboardInterrupt:  # Ctrl-C ends this answer, not the conversation
            pieces.close()
            click.echo(" (interrupted)", nl=False, err=True)
        click.echo()
        # kept without the spaces and newlines around it: the template puts its own between turns
        history[:] = [*turn, {"role": "assistant", "content": "".join(answer).strip()}]
        last = stats


def terminal_text(text: str) -> str:
    """Generated text for a terminal: a bundle's tokenizer may emit escape sequences that drive the terminal, so
    control characters other than newline, tab and carriage return are shown escaped."""
    return "".join(char if char.isprintable() or char in "\n\t\r" else repr(char)[1:-1] for char in text)


def _positive_ints(ctx, param, value: str | None) -> tuple[int, ...] | None:
    """A click callback: ``512,1024`` → (512, 1024)."""
    if value is None:
        return None
    try:
        numbers = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: give whole numbers of tokens separated by commas, e.g. 512,1024"
        ) from None
    if min(numbers) < 1:
        raise click.BadParameter(f"{value!r}: every number must be at least 1")
    return numbers


def _fractions(ctx, param, value: str) -> tuple[float, ...]:
    """A click callback: ``0.1,0.5`` → (0.1, 0.5), each in [0, 1]."""
    try:
        numbers = tuple(float(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give numbers from 0 to 1 separated by commas, e.g. 0.1,0.5,0.9") from None
    if not all(0 <= n <= 1 for n in numbers):
        raise click.BadParameter(f"{value!r}: every depth must lie in [0, 1]")
    return numbers


@contextlib.contextmanager
def task_progress():
    """A progress callback ``(task, done, total)``: rich bars on a terminal, plain lines at every tenth of a task
    (with the seconds since the start) when output goes to a file or a pipe."""
    import time

    from rich.console import Console

    if not Console().is_terminal:
        yield tenth_lines(click.echo, time.monotonic())
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with Progress(*columns, TimeElapsedColumn(), transient=False) as progress:
        tasks: dict[str, Any] = {}

        def bar(task: str, done: int, total: int) -> None:
            if task not in tasks:
                tasks[task] = progress.add_task(one_line(task, 28), total=total)
            progress.update(tasks[task], completed=done, total=total)

        yield bar


def _print_sections(sections) -> None:
    from rich.table import Table
    from rich.text import Text

    console = plain_console()
    for title, columns, rows in sections:
        table = Table(*columns, title=title)
        for row in rows:
            table.add_row(*(Text(one_line(cell, 200)) for cell in row))
        console.print(table)


def _write_json(path: Path, report: dict) -> None:
    import json
    import math

    def finite(value):  # JSON has no NaN: a rate that could not be measured is null
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(item) for item in value]
        return value

    try:
        path.write_text(json.dumps(finite(report), indent=1) + "\n")
    except OSError as error:
        raise EdgecError(f"cannot write --json {path}: {error.strerror or error}") from None
    click.echo(f"wrote {one_line(path)}")


def _write_plots(draw) -> None:
    """Run a plots function; without matplotlib one note line on stderr (the JSON and tables do not need it)."""
    from edgec.plots import PlottingUnavailable

    try:
        written = draw()
    except PlottingUnavailable as missing:
        click.echo(f"note: {missing}", err=True)
        return
    except OSError as error:
        raise EdgecError(
            f"cannot write the PNGs: {error.strerror or error} ({one_line(error.filename or '')})"
        ) from None
    for path in written:
        click.echo(f"wrote {one_line(path)}")


@main.command(name="eval")
@click.argument("bundles", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--text", type=click.Path(path_type=Path), required=True, help="UTF-8 text the metrics draw from.")
@click.option(
    "--reference",
    type=click.Path(path_type=Path),
    default=None,
    help="What the bundles are compared with (agreement, error curve, a baseline perplexity): another bundle, or "
    "the source model (Hugging Face folder or .gguf, run with transformers + torch).",
)
@click.option("--only", default=None, help="Comma-separated metrics to run: " + ", ".join(EVAL_METRICS) + ".")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Write the report here.")
@click.option("--plots", type=click.Path(path_type=Path), default=None, help="Write PNG figures into this folder.")
@click.option(
    "--windows", default=None, callback=_positive_ints, help="Perplexity window lengths [default: 512,1024 that fit]."
)
@click.option(
    "--window-count", type=click.IntRange(1), default=2, show_default=True, help="Perplexity windows per length."
)
@click.option(
    "--lengths", default=None, callback=_positive_ints, help="Passkey prompt lengths [default: 512,1024,2048 that fit]."
)
@click.option("--depths", default="0.1,0.5,0.9", show_default=True, callback=_fractions, help="Passkey depths.")
@click.option("--trials", type=click.IntRange(1), default=1, show_default=True, help="Passkey trials per cell.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Passkey keys.")
@click.option("--prompts", type=click.IntRange(1), default=3, show_default=True, help="Agreement prompts.")
@click.option("--new-tokens", type=click.IntRange(1), default=32, show_default=True, help="Agreement, consistency.")
@click.option("--runs", type=click.IntRange(2), default=3, show_default=True, help="Consistency: runs of one prompt.")
@click.option(
    "--curve-tokens", type=click.IntRange(1), default=None, help="Error curve length [default: 1024 that fit]."
)
@click.option("--threads", type=click.IntRange(1), default=None, help="ONNX Runtime threads [default: its own].")
def evaluate_command(bundles, text, reference, only, json_out, plots, **options) -> None:
    """Measure bundles on a text: perplexity, passkey grid, greedy agreement with and error accumulation against
    a reference, consistency across runs; a table, and --json / --plots files.

    \b
    Example:
      edgec eval smol.cpu.edgec smol-int4.edgec --reference smol.cpu.edgec --text book.txt --plots png/
      edgec eval smol-int4.edgec --reference SmolLM2-135M-Instruct.Q4_1.gguf --text book.txt --json eval.json
      edgec eval smol.cpu.edgec --text book.txt --only perplexity,consistency --windows 1024 --window-count 4
    """
    from edgec.evaluate import EvalSettings, check_metrics, evaluate, summary
    from edgec.load import quiet_progress_environment

    quiet_progress_environment()  # before transformers is imported (a reference model)
    names = [part.strip() for part in only.split(",")] if only else list(EVAL_METRICS)
    options["metrics"] = check_metrics(names, reference, explicit=only is not None)
    with task_progress() as progress:
        report = evaluate(bundles, text, EvalSettings(**options), reference=reference, progress=progress)
    _print_sections(summary(report))
    if skipped := [m for m in names if m not in options["metrics"]]:
        click.echo(f"note: {', '.join(skipped)} need --reference; left out", err=True)
    if json_out is not None:
        _write_json(json_out, report)
    if plots is not None:
        from edgec.plots import eval_plots

        _write_plots(lambda: eval_plots(report, plots))


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--vs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Another engine to compare with (repeatable): an edgec bundle or an onnxruntime-genai model folder.",
)
@click.option("--contexts", default=None, callback=_positive_ints, help="Prompt lengths [default: 256,1024 that fit].")
@click.option("--new-tokens", type=click.IntRange(1), default=32, show_default=True, help="Decode steps per run.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True, help="Alternating rounds.")
@click.option("--threads", type=click.IntRange(1), default=None, help="Threads per engine [default: its own].")
@click.option("--text", type=click.Path(path_type=Path), default=None, help="Prompt text [default: Python's docs].")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Write the report here.")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Write a PNG here.")
def bench(bundle, vs, contexts, new_tokens, rounds, threads, text, json_out, plot) -> None:
    """Time a bundle: time to first token, prefill and decode tokens/s per prompt length, peak RSS and KV bytes;
    with --vs, the same for other engines in alternating rounds, and the per-round ratios.

    Each engine runs in a process of its own (its peak RSS is its own); every engine is fed the same token ids.

    \b
    Example:
      edgec bench smol.cpu.edgec --vs smol-int4.edgec --contexts 256,1024 --rounds 5 --json bench.json --plot bench.png
      edgec bench smol.cpu.edgec --vs genai-fp32/ --threads 2
    """
    from edgec.bench import BenchSettings, summary
    from edgec.bench import bench as run_bench
    from edgec.evaluate import read_text

    prompt_text = read_text(text) if text is not None else None
    settings = BenchSettings(contexts=contexts, new_tokens=new_tokens, rounds=rounds, threads=threads)
    with task_progress() as progress:
        report = run_bench(bundle, vs, settings, text=prompt_text, progress=progress)
    _print_sections(summary(report))
    if json_out is not None:
        _write_json(json_out, report)
    if plot is not None:
        from edgec.plots import bench_plot

        _write_plots(lambda: [bench_plot(report, plot)])


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--steps", type=click.IntRange(4, 512), default=16, show_default=True, help="Timed decode steps each.")
@click.option("--max-threads", type=click.IntRange(1), default=None, help="Try up to this many [default: the cores].")
@click.option("--dry-run", is_flag=True, help="Measure and print; do not store.")
def calibrate(bundle, steps, max_threads, dry_run) -> None:
    """Measure decode speed for each thread count (1, 2, 4, … up to the cores) with ONNX Runtime's threads spinning
    and not, and store the fastest for this bundle on this machine; later loads (``edgec run``, ``chat``,
    ``serve``, ``Model.load``) use it. ``edgec run`` does this by itself the first time; run it again after the
    machine changes (another CPU or core count is calibrated anew by itself).

    \b
    Example:
      edgec calibrate smol.cpu.edgec
    """
    from edgec.bundle import open_bundle
    from edgec.errors import BundleError
    from edgec.runtime.calibration import ROUNDS, candidates, runs_on_cpu, usable_cpus
    from edgec.runtime.calibration import calibrate as measure

    if not runs_on_cpu(open_bundle(bundle)):
        raise BundleError(f"{bundle} does not run on ONNX Runtime's CPU provider: there are no CPU threads to choose")
    settings = candidates(min(max_threads or usable_cpus(), usable_cpus()))

    def report(setting, ms) -> None:
        click.echo(f"  {setting.label:<22} {ms:8.2f} ms/step  ({1000 / ms:.1f} tokens/s)")

    click.echo(
        f"timing {steps} decode steps per setting ({len(settings)} settings, {ROUNDS} passes, every other one in "
        "reverse order; a setting's time is their mean)"
    )
    result = measure(bundle, settings, steps=steps, store=not dry_run, report=report)
    click.echo(f"fastest: {result.best.label} ({result.step_ms[result.best]:.2f} ms/step, the mean of its passes)")
    if result.stored is not None:
        click.echo(f"stored: {result.stored}")
    elif not dry_run:
        click.echo(
            f"not stored: other programs kept {result.busy:.1f} cores busy while measuring; run again on a quiet "
            "machine (this load would use the result above)",
            err=True,
        )


def _end_prompt_bytes(cache: dict, context: int) -> int | None:
    """The temporary state an `end` prompt as long as the context is read into (the runtime's begin_prompt), or
    None where prompts never need one (``chunk``, or as many slots as the context) or the record cannot say."""
    from edgec.kvcache.spec import CacheSpec

    try:
        return CacheSpec.from_json(cache).end_prompt_bytes(context) or None
    except (KeyError, TypeError, ValueError):
        return None


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def inspect(bundle) -> None:
    """Summarise a bundle: source, target, cache, op types, file sizes.

    \b
    Example:
      edgec inspect smol.cpu.edgec
    """
    from rich.table import Table
    from rich.text import Text

    from edgec.bundle import read_manifest, upgrade_manifest
    from edgec.onnx_scan import OnnxFormatError, scan
    from edgec.signing import bundle_signer

    manifest = upgrade_manifest(read_manifest(bundle))
    # build_settings is a record of the build (shown, never relied on); the rest is what the runtime reads
    console = plain_console()

    def say(text: str) -> None:  # every string from the manifest is data: no markup, control characters escaped
        console.print(Text(one_line(text, 2000)))

    source, cache, settings = manifest["source"], manifest["cache"], manifest["build_settings"]
    console.print(Text(one_line(bundle), style="bold"), end="")
    say(f"  format v{manifest['format_version']}, edgec {manifest['edgec_version']}")
    say(f"source: {source['name']} ({source['model_type']}, {source['kind']})")
    say(f"target: {manifest['target']['name']} ({manifest['target']['runtime']})")
    signer = bundle_signer(Path(bundle))
    say(
        f"signature: signed by key {signer} (not checked here: edgec verify --trust PUBKEY)"
        if signer
        else "signature: none"
    )
    runtime = manifest["runtime"]
    if runtime.get("engine"):
        size = manifest["files"][runtime["engine"]]["size"]
        say(
            f"engine: {runtime['engine']} ({size / 2**20:,.1f} MiB), {runtime['library']} "
            f"{runtime.get('version')}, compute capability {runtime.get('compute_capability')}, "
            f"≤ {runtime.get('max_tokens_per_step')} tokens per step; rebuildable from {manifest['model']['file']}"
        )
    say(
        f"context: {manifest['model']['context']} tokens, prefill chunk {runtime['prefill_chunk']}, "
        f"weights {settings.get('weights', 'fp32')}"
    )
    if settings.get("weights") == "int4":
        say(
            f"int4: block {settings.get('block_size')}, {'symmetric' if settings.get('symmetric') else 'zero point'}, "
            f"accuracy level {settings.get('accuracy_level')}"
            + (", activations split" if settings.get("split_activations") else "")
            + f", embedding {settings.get('embedding_bits', 8)} bits, "
            f"method {settings.get('quant_method', 'rtn')}, form {settings.get('int4_form') or 'the target default'}"
            + (f" (calibration text {settings['calib']})" if settings.get("calib") else "")
        )
    if blocks := settings.get("gguf_blocks"):
        say(
            f"gguf blocks: {blocks['carried_exactly']} of {blocks['weights']} weights carried exactly "
            f"(file tensors: {', '.join(f'{n} {t}' for t, n in blocks['tensor_types'].items())})"
        )
    say(
        f"cache: {cache['dtype']}, {len(cache['layers'])} layers, {cache['bytes_per_token']:,} bytes/token, "
        f"{cache['total_bytes'] / 2**20:,.1f} MiB at full capacity"
    )
    if compression := cache.get("compression"):
        compressed = sum(1 for layer in cache["layers"] if layer.get("compressed"))
        say(
            f"compressed cache: {compressed} of {len(cache['layers'])} layers, {compression['capacity']} slots, "
            f"policy {compression['policy']}, {compression['dtype']} (group {compression['group']}), "
            f"sink {compression['sink']}, window {compression['window']}, prefill-compress "
            f"{compression['prefill_compress']}; k+v {cache.get('kv_bytes_per_token', 0):,.0f} bytes/token"
        )
        if (whole := _end_prompt_bytes(cache, manifest["model"]["context"])) is not None:
            say(
                f"  a prompt of {manifest['model']['context']} tokens is read whole first (prefill-compress end): "
                f"{whole / 2**20:,.1f} MiB of temporary state beside the slots at its peak"
            )
        if compression.get("mixed", "none") != "none":
            wide = compression["sink"] + compression["window"]
            say(
                f"  mixed precision: {wide} slots per head (sinks, window, protected) in {compression['mixed']}, "
                f"the other {compression['capacity'] - wide} in {compression['dtype']}"
            )
        if compression.get("rotation", "none") != "none":
            say(f"  rotated before storage: {compression['rotation']} (seed {compression['rotation_seed']})")
        if compression.get("recall"):
            say(
                f"  recall: {compression['recall']} blocks of {compression['recall_block']} tokens per KV head into "
                f"{compression['recall'] * compression['recall_block']} reserved slots, every "
                f"{compression['recall_every']} step(s), from a host tier of every token"
            )
    if cache.get("ring_kv_bytes"):
        rings = sum(1 for layer in cache["layers"] if layer.get("window") and not layer.get("compressed"))
        say(f"sliding-window rings: {rings} layers, {cache['ring_kv_bytes'] / 2**20:,.1f} MiB k+v (fixed)")
    validation = manifest["validation"]
    say(
        f"validation against the source model: top-1 agreement {validation['top1_agreement']:.0%}, "
        f"max |Δlogit| {validation['max_abs_logit_error']:.2e} on {validation['prompts']} prompts"
        + (
            f"; verify --compare holds it to its own recorded logits within {validation['compare_tolerance']:g}"
            if "compare_tolerance" in validation
            else ""
        )
    )
    say(f"chat: {'yes' if manifest['tokenizer']['chat_format'] else 'no'} ({manifest['tokenizer']['chat_note']})")
    try:
        ops = scan(Path(bundle) / manifest["model"]["file"]).top_level
    except (OnnxFormatError, OSError) as error:
        raise EdgecError(f"{manifest['model']['file']} in {bundle} is not a readable ONNX model ({error})") from None
    table = Table("op type", "count", title="graph ops (top level)")
    for op, count in sorted(ops.items(), key=lambda item: (-item[1], item[0])):
        table.add_row(Text(one_line(op)), str(count))
    console.print(table)
    files = Table("file", "bytes", "sha256", title="files")
    for name, entry in manifest["files"].items():
        files.add_row(Text(name), f"{entry['size']:,}", Text(one_line(entry["sha256"][:16])))
    console.print(files)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--compare", is_flag=True, help="Also run the bundle against its stored reference logits.")
@click.option(
    "--trust",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Public key (edgec keygen) the bundle must be signed by; repeat to accept several.",
)
def verify(bundle, compare, trust) -> None:
    """Check a bundle: manifest, every file's sha256, the exact file set, the graph's references, the signature,
    the runtime library and GPU here.

    One line per check; exit code 1 when any check fails.

    \b
    Example:
      edgec verify smol.cpu.edgec --compare
      edgec verify smol.cpu.edgec --trust release.pub
    """
    from edgec.verify import verify as run_verify

    checks = run_verify(bundle, compare=compare, trust=list(trust) or None)
    for check in checks:
        click.echo(check.line())
    failed = sum(check.status == "fail" for check in checks)
    click.echo(f"{failed} failed, {len(checks) - failed} passed or skipped" if failed else "bundle verified")
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Archive (.tar) to write.")
@click.option("--wheels", is_flag=True, help="Include the runtime's wheels and an offline install script.")
@click.option("--python", "python_version", default=None, help="Python of the target machine, e.g. 3.10.")
@click.option("--platform", default=None, help="pip platform tag of the target, e.g. manylinux2014_x86_64.")
@click.option(
    "--sign",
    "sign_key",
    type=click.Path(path_type=Path),
    default=None,
    help="Sign the pack (and an unsigned bundle in it) with this private key (edgec keygen).",
)
def pack(bundle, output, wheels, python_version, platform, sign_key) -> None:
    """Pack a bundle (and optionally the runtime's wheels) into one archive for an offline machine.

    \b
    Example:
      edgec pack smol.cpu.edgec -o smol.tar --wheels --python 3.10 --platform manylinux2014_x86_64
      edgec pack smol.cpu.edgec -o smol.tar --sign release.key
    """
    from edgec.pack import pack as run_pack

    key = None
    if sign_key is not None:
        from edgec.signing import load_signing_key

        key = load_signing_key(sign_key)
    run_pack(bundle, output, wheels=wheels, python=python_version, platform=platform, sign=key)
    signed = f", signed by key {key.key_id}" if key else ""
    click.echo(f"wrote {output} ({output.stat().st_size / 2**20:,.1f} MiB{signed})")


@main.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Folder to unpack into.")
@click.option(
    "--trust",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Public key (edgec keygen) the pack must be signed by; repeat to accept several.",
)
def unpack(archive, output, trust) -> None:
    """Unpack an archive made by `edgec pack`: only the files its PACK.json lists, each checked, then the bundle.

    \b
    Example:
      edgec unpack smol.tar -o deploy/ --trust release.pub && sh deploy/install.sh
    """
    from edgec.pack import unpack as run_unpack

    bundle = run_unpack(archive, output, trust=list(trust) or None)
    checked = "signed by a trusted key, " if trust else "not signature-checked (pass --trust PUBKEY), "
    click.echo(f"unpacked {one_line(bundle)} ({checked}every file's size and sha256 checked)")


@main.command()
@click.argument("name", type=click.Path(path_type=Path))
def keygen(name) -> None:
    """Make an Ed25519 key pair: NAME.key (private: keep it off the deployment machines) and NAME.pub.

    With EDGEC_KEY_PASSPHRASE set, the private key is encrypted with it (and read with it later).

    \b
    Example:
      edgec keygen release && edgec build MODEL -o smol.edgec --sign release.key
    """
    from edgec.signing import generate_keypair, key_id, load_public_keys

    private, public = generate_keypair(name)
    click.echo(f"wrote {private} (private, mode 600) and {public}; key id {key_id(load_public_keys(public)[0])}")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-sessions", type=int, default=8, show_default=True, help="Generations running at once.")
@click.option("--queue", "queue_size", type=int, default=16, show_default=True, help="Requests that may wait.")
@click.option(
    "--memory",
    default=None,
    help="Memory the server may use, e.g. 2GiB (GPU memory for a GPU bundle; without it, what the GPU has free): "
    "sessions get smaller caches, then wait.",
)
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads [default: its own].")
@click.option(
    "--max-prompt-tokens",
    type=int,
    default=None,
    help="Longest prompt served; one this long is read at start to measure memory [default: the context - 1].",
)
@click.option("--triton", is_flag=True, help="Serve through Triton Inference Server (PyTriton's wheel) instead.")
@click.option("--model-name", default=None, help="--triton: the model's name [default: the bundle's folder name].")
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path),
    default=None,
    help="--triton: the Python whose environment runs the model (edgec's runtime and numpy < 2, which the "
    "backend stub of PyTriton's wheel needs) [default: this one].",
)
def serve(
    bundle, host, port, max_sessions, queue_size, memory, threads, max_prompt_tokens, triton, model_name, python
) -> None:
    """Serve a bundle: the OpenAI chat and completions API (streamed by server-sent events), /v1/models, /health,
    Prometheus /metrics. One loaded model, one cache state per running session (docs/serving.md).

    \b
    Example:
      edgec serve smol.edgec --port 8000 --memory 1GiB --max-sessions 8
      curl localhost:8000/v1/chat/completions -d '{"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from edgec.plan import parse_memory
    from edgec.serve import require

    limit = parse_memory(memory) if memory is not None else None
    if triton:
        require("triton")
        from edgec.serve.triton import serve_triton

        serve_triton(bundle, host, port, model_name, 1, echo=click.echo, python=python)
        return
    require("serve")
    from edgec.serve import serve as run_server

    run_server(bundle, host, port, max_sessions, limit, queue_size, threads, click.echo, max_prompt_tokens)


@main.group()
def export() -> None:
    """Write a bundle in another serving system's layout."""


@export.command(name="triton")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Model repository folder.")
@click.option("--model-name", default=None, help="The model's name [default: the bundle's folder name].")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (each loads the bundle).")
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path),
    default=None,
    help="The Python whose environment runs the model (its site-packages go into config.pbtxt) [default: this one].",
)
def export_triton(bundle, output, model_name, instances, python) -> None:
    """A Triton Inference Server model repository: config.pbtxt (decoupled: streamed responses), version folder 1/
    with a Python-backend model.py that runs the edgec runtime on a copy of the bundle.

    \b
    Example:
      edgec export triton smol.edgec -o repo && tritonserver --model-repository repo
    """
    from edgec.serve.triton import export_repository

    folder = export_repository(bundle, output, model_name, instances, python)
    click.echo(
        f"wrote {folder} (Triton model {folder.name!r}; stream with POST /v2/models/{folder.name}/generate_stream)"
    )


if __name__ == "__main__":
    main()
