"""``edgespec chat``: a conversation in the terminal through the package's chat template, as
``ollama run`` and ``llama-cli -cnv`` hold one: replies streamed, the history kept.

Typed at a terminal: a ``>>> `` prompt, /commands, Ctrl-C stops a reply (not the session).
Piped (stdin not a terminal): each line is a message, each reply printed on stdout and ended
by a newline, nothing else there; the /commands work the same. Notes and stats go to stderr.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

import click

from edgespec.cli.base import (
    check_chat_template,
    constraint_from,
    constraint_options,
    loader,
    main,
    sampling_line,
    sampling_options,
    user_errors,
)
from edgespec.config import (
    DRAFTERS,
    PROVIDERS,
    SCHEDULES,
    GenerationConfig,
    check_draft_length,
    resolve_sampling,
)
from edgespec.errors import EdgespecError

_DEFAULTS = GenerationConfig()
COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation so far",
    "/stats": "show (or stop showing) a stats line after each reply",
    "/exit": "leave (also /bye, or Ctrl-D)",
}
# The room a reply is promised when the history is trimmed to the context window, without
# --max-new-tokens: a quarter of the window, at most this many tokens
REPLY_ROOM = 512


@main.command()
@click.argument("package", required=False, type=click.Path(path_type=Path))
@click.option("--system", help="A system message that starts the conversation.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(1),
              help="The longest reply. [default: the rest of the context window]")
@sampling_options
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--draft-length", "-k", default=_DEFAULTS.draft_length, show_default=True,
              help="Draft length k: every round's (fixed), the first (heuristic), the most "
                   "(adaptive).")
@click.option("--schedule", default=_DEFAULTS.schedule, show_default=True,
              type=click.Choice(SCHEDULES), help="How each round's draft length is chosen.")
@click.option("--drafter", default=_DEFAULTS.drafter, show_default=True,
              type=click.Choice(DRAFTERS),
              help="What proposes tokens: the package's draft model, an n-gram lookup, or "
                   "none; auto: model if the package has one, else ngram.")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDERS))
@constraint_options
@user_errors
def chat(package: Path | None, system: str | None, max_new_tokens: int | None,
         temperature: float | None, top_k: int | None, top_p: float | None,
         min_p: float | None, repetition_penalty: float | None,
         presence_penalty: float | None, frequency_penalty: float | None, seed: int | None,
         draft_length: int, schedule: str, drafter: str,
         provider: str, json_schema: Path | None, json_object: bool, regex: str | None,
         grammar: Path | None) -> None:
    """Chat with the model in PACKAGE through its chat template (default: the demo pair,
    which has none). At a terminal: /help lists the commands, Ctrl-C stops a reply. Piped:
    each line is a message, each reply goes to stdout, ended by a newline."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty}
    # settings refused now, before the slow load (the draft length by the option's name)
    check_draft_length("--draft-length", draft_length)
    config = GenerationConfig(sampling=resolve_sampling(given, {}), schedule=schedule,
                              seed=seed, drafter=drafter, draft_length=draft_length,
                              constraint=constraint_from(json_schema, json_object, regex,
                                                         grammar))
    path = check_chat_template(package)
    pipe = loader()(path, provider=provider)
    config = replace(config, sampling=resolve_sampling(given, pipe.manifest.generation))
    session = ChatSession(pipe, config, max_new_tokens, system)
    interactive = sys.stdin.isatty()
    # any bytes a terminal or a pipe sends are a message: those that are not UTF-8 read as
    # U+FFFD (input() decodes with sys.stdin's errors too), instead of ending the session
    with contextlib.suppress(AttributeError):  # a stdin that is not a TextIOWrapper
        sys.stdin.reconfigure(errors="replace")
    if interactive:
        with contextlib.suppress(ImportError):  # line editing and history at the prompt
            import readline  # noqa: F401
    click.echo(sampling_line(given, pipe.manifest.generation), err=True)
    if interactive:
        click.echo("/help for commands, /bye or Ctrl-D to leave; Ctrl-C stops a reply",
                   err=True)
    while (line := _read(interactive)) is not None:
        if not line.strip():
            continue
        if line.startswith("/"):
            if not session.command(line.strip()):
                return
            continue
        session.turn(line.rstrip("\n"), interactive)


def _read(interactive: bool) -> str | None:
    """The next line typed or piped; None at the end (Ctrl-D, end of the input)."""
    if not interactive:
        line = sys.stdin.readline()
        return line or None
    while True:
        try:
            return input(">>> ")
        except EOFError:
            click.echo()
            return None
        except KeyboardInterrupt:  # at the prompt: not a way out, say which is
            click.echo("\n(Ctrl-C stops a reply; /bye or Ctrl-D leaves)", err=True)


class ChatSession:
    """The conversation so far and what a turn does with it: trim it to the context window,
    stream the reply (Ctrl-C cancels it), keep it."""

    def __init__(self, pipe, config: GenerationConfig, max_new_tokens: int | None,
                 system: str | None):
        self.pipe, self.config, self.max_new_tokens = pipe, config, max_new_tokens
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict] = []  # user and assistant messages, in turns
        self.show_stats = False
        self.said_trimmed = False

    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name = line.split()[0].lower()
        if name in ("/exit", "/bye", "/quit"):
            return False
        if name == "/reset":
            self.history.clear()
            click.echo("(the conversation is forgotten)", err=True)
        elif name == "/stats":
            self.show_stats = not self.show_stats
            click.echo(f"(stats {'on' if self.show_stats else 'off'})", err=True)
        elif name == "/help":
            for command, what in COMMANDS.items():
                click.echo(f"  {command:<8} {what}", err=True)
        else:
            click.echo(f"unknown command {name}; /help lists them", err=True)
        return True

    def turn(self, message: str, interactive: bool) -> None:
        """One user message and the reply to it; a message the template or the window refuses
        is said on stderr and left out of the history, and the session goes on."""
        self.history.append({"role": "user", "content": message})
        try:
            ids = self._fitted()
            text, cancelled, stats = self._reply(ids)
        except EdgespecError as e:
            self.history.pop()
            click.echo(f"error: {e}", err=True)
            return
        except KeyboardInterrupt:  # Ctrl-C while the template renders: its child is ended
            self.history.pop()
            click.echo("(stopped before the reply; the message is left out of the history)",
                       err=True)
            return
        if text:  # a reply stopped early is kept as far as it went: the user read it
            self.history.append({"role": "assistant", "content": text})
        else:
            self.history.pop()
        click.echo()
        if cancelled:
            click.echo("(reply stopped; " + ("what it said stays in the history)" if text else
                                             "the message is left out of the history)"),
                       err=True)
        if self.show_stats:
            click.echo(f"({stats.summary()})", err=True)
        if interactive:
            click.echo()

    def _fitted(self) -> list[int]:
        """The conversation's ids, its oldest turns dropped while it leaves a reply less than
        its room (--max-new-tokens, else a quarter of the window, at most REPLY_ROOM)."""
        limit = self.pipe.manifest.max_positions
        room = self.max_new_tokens or min(REPLY_ROOM, limit // 4)
        ids = self.pipe.encode_chat(self.system + self.history)
        while len(ids) + room > limit and len(self.history) > 1:
            del self.history[:2]  # the oldest user message and the reply to it
            if not self.said_trimmed:
                click.echo(f"(the conversation outgrew the context window of {limit} tokens: "
                           "its oldest turns are dropped from now on)", err=True)
                self.said_trimmed = True
            ids = self.pipe.encode_chat(self.system + self.history)
        if len(ids) >= limit:
            raise EdgespecError(f"this message takes {len(ids)} tokens with the template, the "
                                f"whole context window ({limit}); write less")
        return ids

    def _reply(self, ids: list[int]):
        """Stream the reply to stdout; Ctrl-C meanwhile cancels it (TextStream.cancel, from
        the signal handler: the loop ends at its next round, with its result)."""
        budget = self.max_new_tokens or self.pipe.manifest.max_positions - len(ids)
        config = replace(self.config, max_new_tokens=budget)
        stream = self.pipe.chat_stream(self.system + self.history, config, prompt_ids=ids)
        handles_signals = threading.current_thread() is threading.main_thread()
        if handles_signals:
            previous = signal.signal(signal.SIGINT, lambda signum, frame: stream.cancel())
        try:
            for piece in stream:
                click.echo(piece, nl=False)
                sys.stdout.flush()
        finally:
            if handles_signals:
                signal.signal(signal.SIGINT, previous)
        result = stream.result
        return result.text, result.stats.finish_reason == "cancelled", result.stats
