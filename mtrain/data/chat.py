"""Chat and prompt/completion examples as token ids with loss masks, as ``transformers`` and
TRL make them.

    template = ChatTemplate(chat_template(folder), vocab)    # the model folder's template
    ids, mask = template.encode(messages, where="train.jsonl:7")
    ids, mask = prompt_completion(vocab, "In the beginning", " God created")
    prompt_ids = template.prompt(messages[:-1])               # generation stops at
    template.end_of_turn                                      # this id (<|im_end|>)

A template is compiled as ``transformers`` compiles chat templates (a sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``, its ``tojson`` filter,
``raise_exception`` and ``strftime_now``, and the ``{% generation %}`` tag), rendered with
``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None), the
vocabulary's ``bos_token``, ``eos_token``, ``pad_token`` and ``unk_token`` where it has
them, and the variables given to `ChatTemplate`. The text is tokenised with no special
tokens added, its special tokens' text read as them (``apply_chat_template(tokenize=True)``):
the template decides whether a BOS comes first.

The mask is 1 on what the assistant says. A template that marks it with ``{% generation %}``
... ``{% endgeneration %}`` gives it as ``return_assistant_tokens_mask`` does: for each span,
the tokens from the one holding its first character to the first one holding its last.
Without the marks, the assistant's part of message i is the text that rendering messages[:i +
1] adds to messages[:i] rendered with the generation prompt (TRL's way), up to the end of
turn (`ChatTemplate.end_of_turn`) it holds: what a template writes after the token
generation stops at is no one's to learn (ChatML's newline). Two ways that differ from
``transformers`` where it is wrong: a span's first (last) character that no token holds
moves the edge to the next (previous) one that is held, where ``transformers`` drops the
span and those after it (masks to the end of the text), and a span at the very start of the
text is kept, where ``transformers`` does not record it.
"""

from __future__ import annotations

import json
import re
import threading
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mtrain.errors import DataError, first_line

ROLES = ("system", "user", "assistant", "tool")
_MARKED = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for the marks
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatError(DataError):
    """A conversation a chat template cannot make an example of, or a template that cannot
    be used."""


class _Rejected(jinja2.TemplateError):
    """A template's raise_exception(message)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: renders its body, and records where in
    the output it lands while a render tracks it (transformers' AssistantTracker)."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.local = threading.local()  # .track: [characters yielded so far, spans] or None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("support"), [], [], body
                                      ).set_lineno(lineno)

    def support(self, caller):
        text = caller()
        track = getattr(self.local, "track", None)
        if track is not None:
            track[1].append((track[0], track[0] + len(text), text))
        return text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: jinja2's escapes HTML characters and takes no options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise _Rejected(str(message))


def _strftime_now(format):
    return datetime.now().strftime(format)


class ChatTemplate:
    """A chat template (jinja2 source) with the vocabulary `vocab` it tokenises with.
    `name` says which template in messages; `variables` are given to every render (e.g.
    ``enable_thinking=False``)."""

    def __init__(self, template: str, vocab, *, name: str = "the chat template",
                 **variables):
        self.source, self.vocab, self.name, self.variables = template, vocab, name, variables
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatError(f"{name} is not a jinja2 template: {first_line(e)} (line "
                            f"{e.lineno})") from None
        except Exception as e:
            raise ChatError(f"{name} is not a jinja2 template: {first_line(e)}") from None
        self._tracker = next(x for x in env.extensions.values() if isinstance(x, _Generation))
        self.marked = bool(_MARKED.search(template))  # whether it has {% generation %}
        self._end_of_turn = None
        tokens = {"bos_token": vocab.bos_id, "eos_token": vocab.eos_id,
                  "pad_token": vocab.pad_id, "unk_token": vocab.unk_id}
        self._context = {"tools": None, "documents": None,
                         **{k: vocab.piece(i) for k, i in tokens.items() if i is not None},
                         **variables}

    def describe(self) -> str:
        """Which template this is, for the prepared data's key: a digest of its text and
        variables."""
        import hashlib

        text = self.source + repr(sorted(self.variables.items()))
        return f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def __getstate__(self):  # for the input pipeline's worker processes: compiled again
        return {"template": self.source, "vocab": self.vocab, "name": self.name,
                "variables": self.variables}

    def __setstate__(self, state):
        self.__init__(state["template"], state["vocab"], name=state["name"],
                      **state["variables"])

    @property
    def end_of_turn(self) -> int:
        """The id generation stops at: the first special token after the assistant's words
        in what the template makes of [user 'x', assistant 'y'] (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>), else the vocabulary's EOS."""
        if self._end_of_turn is None:
            self._end_of_turn = self._find_end_of_turn()
        return self._end_of_turn

    def _find_end_of_turn(self) -> int:
        try:
            text, spans = self.render(_PROBE)
            spans = spans if self.marked else self._prefix_spans(_PROBE, text, "")
        except ChatError:
            return self.vocab.eos_id
        for start, end in spans[:1]:
            words = text.find("y", start, end)
            ids, offsets = self._tokens(text)
            for i, (a, _) in zip(ids, offsets):
                if words >= 0 and words < a < end and self.vocab.is_special(i):
                    return i
        return self.vocab.eos_id

    def render(self, messages, add_generation_prompt: bool = False, *, where: str = ""
               ) -> tuple[str, list[tuple[int, int]]]:
        """The text of `messages` and the character spans of its ``{% generation %}``
        blocks."""
        blocks, track = [], [0, []]
        self._tracker.local.track = track
        try:
            for block in self._template.generate(messages=messages,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self._context):
                blocks.append(block)
                track[0] += len(block)
        except _Rejected as e:
            raise ChatError(f"{_at(where)}{self.name} rejects this conversation: "
                            f"{' '.join(str(e).split())}") from None
        except Exception as e:
            raise ChatError(f"{_at(where)}{self.name} cannot render this conversation: "
                            f"{first_line(e)}") from None
        finally:
            self._tracker.local.track = None
        text = "".join(blocks)
        for start, end, body in track[1]:
            if text[start:end] != body:
                raise ChatError(f"{_at(where)}{self.name} has a {{% generation %}} block inside "
                                f"a macro or a block whose output cannot be placed: move it "
                                f"out to the template's top level or loops")
        return text, [(start, end) for start, end, _ in track[1]]

    def encode(self, messages, *, where: str = "") -> tuple[list[int], list[int]]:
        """The ids of `messages` rendered and tokenised, and their mask: 1 on the
        assistant's tokens (see the module doc). `where` (a file and line) starts errors."""
        check_messages(messages, where)
        text, spans = self.render(messages, where=where)
        ids, offsets = self._tokens(text)
        if not self.marked:
            spans = self._prefix_spans(messages, text, where)
        holder = [-1] * len(text)  # the first token holding each character, -1: none
        for k in range(len(offsets) - 1, -1, -1):
            start, end = offsets[k]
            holder[start:end] = [k] * (end - start)
        mask = [0] * len(ids)
        for start, end in spans:
            held = [holder[c] for c in range(start, end) if holder[c] >= 0]
            if not held:
                continue
            first, last = held[0], held[-1]
            if not self.marked and self.end_of_turn in ids[first:last + 1]:
                last = ids.index(self.end_of_turn, first, last + 1)
            mask[first:last + 1] = [1] * (last + 1 - first)
        if not any(mask):
            raise ChatError(f"{_at(where)}no assistant tokens in this conversation with "
                            f"{self.name}")
        return ids, mask

    def prompt(self, messages, *, where: str = "") -> list[int]:
        """The ids to generate the next assistant message after `messages` from: rendered
        with the generation prompt."""
        check_messages(messages, where)
        return self._tokens(self.render(messages, True, where=where)[0])[0]

    def _tokens(self, text: str):
        return self.vocab.encode_with_offsets(text, specials=True)

    def _prefix_spans(self, messages, text: str, where: str) -> list[tuple[int, int]]:
        """The character spans of the assistant's messages in `text` (messages rendered),
        told by rendering the conversation prefix by prefix."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], True, where=where)[0]
            upto = self.render(messages[:i + 1], where=where)[0]
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ChatError(
                    f"{_at(where)}{self.name} does not render conversations prefix by prefix "
                    f"(message {i} changes the text before it), so the assistant's tokens "
                    f"cannot be told: mark them with {{% generation %}} ... "
                    f"{{% endgeneration %}} in the template")
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return spans


def check_messages(messages, where: str = "") -> None:
    """ChatError unless `messages` is a list of {"role": ..., "content": str} dicts with
    roles of `ROLES`."""
    if not isinstance(messages, (list, tuple)):
        raise ChatError(f"{_at(where)}a conversation is a list of messages, not "
                        f"{type(messages).__name__}")
    for k, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ChatError(f"{_at(where)}message {k} is not a {{\"role\": ..., \"content\": "
                            f"...}} object with string values")
        if message["role"] not in ROLES:
            raise ChatError(f"{_at(where)}message {k} has an unknown role "
                            f"'{message['role']}' (roles: {', '.join(ROLES)})")


def prompt_completion(vocab, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """TRL's prompt/completion example: [BOS where the vocabulary has one] + the prompt's ids
    + the completion's ids + [EOS], and its mask: 1 on the completion's ids and the EOS."""
    head = ([vocab.bos_id] if vocab.bos_id is not None else []) + vocab.encode(prompt)
    tail = vocab.encode(completion) + [vocab.eos_id]
    return head + tail, [0] * len(head) + [1] * len(tail)


def _at(where: str) -> str:
    return f"{where}: " if where else ""
