"""Input processing: validate, apply the chat template, tokenize."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tokenizers import Tokenizer

from engine import cache_files, chat_templates, envs, structured_outputs
from engine.background import in_background
from engine.lora import LoRARequest
from engine.messages import EngineCoreRequest, EngineInfo
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# A prompt is a string, or a dict with "prompt_token_ids" (vLLM's TokensPrompt).
PromptType = str | dict[str, Any]


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A prompt tokenized and checked against its params by ``InputProcessor.prepare``: the
    engine takes it as it is (``AsyncLLM.generate_prepared``), without checking it again."""

    text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None  # its LoRA adapter; None: the base model


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, as ``AutoTokenizer.from_pretrained`` loads it (once per process
    while the folder is unchanged: ``_load_unchanged``).

    AutoTokenizer chooses the class through transformers' configuration code, which imports
    torch: 1.5 s of a 2-core machine, in an API process that needs no torch otherwise. So the
    class it chose is recorded (LUMEN_TOKENIZER_DIR), keyed by the transformers version, the
    folder and its files' sizes and times, and a later load of the unchanged folder imports
    and calls only that class, as AutoTokenizer would have.
    """
    record = _class_record(path)
    if record is None:
        return _load(path, None)
    return _load_unchanged(path, record[0], json.dumps(record[1]))


# By the record and its key (the folder, its files' sizes and times, the transformers version):
# a second LLM or AsyncLLM of an unchanged folder shares the first one's tokenizer, as vLLM's
# cached tokenizers are shared, instead of parsing tokenizer.json again (0.2 s). Lumen only
# reads it; a caller that reconfigures it changes it for the others.
@functools.lru_cache(maxsize=4)  # folders' tokenizers kept (Gemma's is 33 MB of JSON)
def _load_unchanged(path: str, record: Path, key: str) -> PreTrainedTokenizerBase:
    return _load(path, (record, json.loads(key)))


def _load(path: str, record: tuple[Path, dict[str, Any]] | None) -> PreTrainedTokenizerBase:
    cls = _recorded_class(*record) if record else None
    if cls is not None:
        tokenizer = cls.from_pretrained(path, _from_auto=True)  # AutoTokenizer's own call
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, **_plain_config(path))
        if record is not None:
            _record_class(*record, type(tokenizer))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{path} has no fast tokenizer (tokenizer.json), which Lumen needs")
    return tokenizer


def _class_record(path: str) -> tuple[Path, dict[str, Any]] | None:
    """Where the class AutoTokenizer chose for the folder as it is now is recorded, and the
    key the record must carry; None for a folder whose tokenizer is remote code."""
    from transformers import __version__ as transformers_version

    folder = Path(path)
    try:
        if "auto_map" in json.loads((folder / "tokenizer_config.json").read_text()):
            return None
        stats = sorted((f.name, f.stat()) for f in folder.iterdir() if f.is_file())
    except (OSError, ValueError):
        return None
    files = [[name, st.st_size, st.st_mtime_ns] for name, st in stats]  # as JSON reads it back
    key = {"transformers": transformers_version, "folder": str(folder.resolve()), "files": files}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return envs.tokenizer_dir() / f"{digest}.json", key


def _recorded_class(record: Path, key: dict[str, Any]) -> type[PreTrainedTokenizerBase] | None:
    from transformers import PreTrainedTokenizerBase

    entry = cache_files.read_json(record, "the recorded tokenizer class")
    if entry is None or entry.get("key") != key:
        return None
    module, name = entry.get("module"), entry.get("class")
    if not isinstance(module, str) or not module.startswith("transformers.") or not name:
        return None
    cls = getattr(importlib.import_module(module), str(name), None)
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _record_class(record: Path, key: dict[str, Any], cls: type) -> None:
    if cls.__module__.startswith("transformers."):
        entry = {"key": key, "module": cls.__module__, "class": cls.__qualname__}
        cache_files.write_json(record, entry, "the tokenizer class")


def _plain_config(path: str) -> dict[str, Any]:
    """AutoTokenizer's ``config``, read as a plain PreTrainedConfig where the folder's
    tokenizer_config.json names its tokenizer class.

    AutoTokenizer reads the model's config for its model_type, tokenizer_class and name only.
    Through AutoConfig it imports the architecture's config module, which in transformers 5
    imports torch.distributed.tensor: 1.1-1.3 s on a 2-core machine, in every server's API
    process. The plain config carries the same fields. A folder whose tokenizer_config.json
    names no class is left to AutoConfig: AutoTokenizer then maps the config's type to a class.
    """
    folder = Path(path)
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config:
        return {}
    if not isinstance(config, dict) or "model_type" not in config:
        return {}
    from transformers import PreTrainedConfig

    return {"config": PreTrainedConfig.from_dict(config, _name_or_path=path)}


# apply_chat_template's own parameters: a template variable of one of these names would change
# the call instead of reaching the template.
_RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs",
})  # fmt: skip


def _own_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's default chat template (a dict of named ones: its "default")."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object of named values")
    if taken := sorted(set(kwargs) & _RESERVED_TEMPLATE_NAMES):
        raise ValueError(
            f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do"
        )
    return kwargs


def _check_sampling_defaults(defaults: dict[str, Any]) -> None:
    """At start, not in every request's 400: the generation config's values must be valid
    (SamplingParams checks them; its max_tokens is the config's max_new_tokens)."""
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the model's generation config: {e} (--generation-config none ignores it)"
        ) from None


def plain_encoder(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The tokenizer's Rust backend as transformers encodes one text with it: no truncation,
    no padding, special tokens in the text read as special (unless the tokenizer splits them).

    Transformers' own call sends even one text through ``encode_batch``, whose thread pool
    wakes on every call: about half of a served request's tokenizing on 2 busy cores. This is a
    copy, so that a transformers call that configures the backend cannot change it. Made once
    for a tokenizer (0.1 s): the LLMs that share a tokenizer (``_load_unchanged``) share it too."""
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    made = _ENCODERS.get(tokenizer)
    if made is not None and made.encode_special_tokens == split:
        return made
    encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    encoder.encode_special_tokens = split
    _ENCODERS[tokenizer] = encoder
    return encoder


_ENCODERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Tokenizer] = (
    weakref.WeakKeyDictionary()
)


def start_loading_tokenizer(path: str) -> Future[PreTrainedTokenizerBase]:
    """``load_tokenizer`` on a thread of its own. Started before the core process, it overlaps
    the core's start-up instead of following its READY: a first load imports about 1.5 s of
    transformers on a 2-core machine, which every start of a server or an ``LLM`` paid."""
    return in_background(load_tokenizer, path, name="lumen-tokenizer")


class InputProcessor:
    """Turns what a user sends into EngineCoreRequests, or a ValueError that says why not."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        info: EngineInfo,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # The template chats render with: the tokenizer's, or one given (--chat-template).
        self.chat_template: str | None = _own_template(tokenizer)
        self.encoder = plain_encoder(tokenizer)
        self.info = info
        self.vocab_size = vocab_size
        # What a request that leaves a field out gets (EngineConfig.generation_config).
        self.sampling_defaults = dict(sampling_defaults or {})
        eos = list(eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = eos

    @classmethod
    def for_model(
        cls,
        path: str,
        info: EngineInfo,
        tokenizer: Future[PreTrainedTokenizerBase] | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> InputProcessor:
        """The processor of a model folder: its tokenizer (``tokenizer``'s, where one is being
        loaded already), vocabulary and EOS ids."""
        model_config = ModelConfig.from_path(path)
        if sampling_defaults:
            _check_sampling_defaults(sampling_defaults)
            logger.info(
                "sampling defaults from the model's generation config, where a request leaves "
                "them out: %s (--generation-config none ignores them)",
                ", ".join(f"{k} {v}" for k, v in sampling_defaults.items()),
            )
        return cls(
            tokenizer.result() if tokenizer is not None else load_tokenizer(path),
            info,
            vocab_size=model_config.vocab_size,
            eos_token_ids=model_config.eos_token_ids,
            sampling_defaults=sampling_defaults,
        )

    @property
    def template_writes_llama3_calls(self) -> bool:
        """Whether the template writes tool calls as Llama 3's do (<|python_tag|>, ipython
        turns): service/tool_llama3.py reads them then."""
        template = self.chat_template
        return isinstance(template, str) and ("<|python_tag|>" in template or "ipython" in template)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders tools itself (service/tools.py renders them for
        one that does not)."""
        template = self.chat_template
        return isinstance(template, str) and "tools" in template

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encoder.encode(prompt, add_special_tokens=True).ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        raise ValueError(
            "a prompt must be a string or a dict with prompt_token_ids, "
            f"got {type(prompt).__name__}"
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the chat template, tokenized. ``template_kwargs`` (vLLM's
        ``chat_template_kwargs``, such as Qwen3's ``enable_thinking``) become variables of the
        template; a name the call itself takes is refused."""
        kwargs = _template_kwargs(template_kwargs)
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError("each message must be a dict with a role")
            if not isinstance(m.get("content", ""), str):
                raise ValueError("message content must be a string (this model takes text only)")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                "the model has no chat template (a base model, or a file that carries none): "
                f"give one with --chat-template ({chat_templates.HOW}); "
                "or send a completion request"
            )
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            # Transformers takes a list of dicts or functions; a list is invariant.
            tools=cast("list[dict[str, Any] | Callable[..., Any]] | None", tools),
            tokenize=False,
            **kwargs,
        )
        # As transformers tokenizes a rendered chat: the template wrote the special tokens.
        return self.encoder.encode(cast(str, text), add_special_tokens=False).ids

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_ns: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """The wire request; call ``validate`` first (once per prompt, not per sample)."""
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not (-(1 << 63) <= priority < (1 << 63))
        ):
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_ns=arrival_ns if arrival_ns is not None else time.time_ns(),
            priority=priority,
            lora_request=lora_request,
        )

    def prepare(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> PreparedPrompt:
        """Tokenize (token ids pass through) and validate: a ValueError says what is wrong."""
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        return PreparedPrompt(text, ids, params, lora_request)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        max_len = self.info.max_model_len
        if n > max_len:
            raise ValueError(
                f"the prompt is {n} tokens long, more than the maximum context length "
                f"of {max_len} tokens"
            )
        for tid in prompt_token_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < self.vocab_size:
                raise ValueError(
                    f"token id {tid!r} is outside the vocabulary (0 to {self.vocab_size - 1})"
                )
        for tid in params.stop_token_ids:
            if tid >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {tid} is outside the vocabulary")
        cap = self.info.max_logprobs
        limit = self.vocab_size if cap < 0 else min(cap, self.vocab_size)
        if params.logprobs is not None and params.logprobs > limit:
            raise ValueError(
                f"{params.logprobs} log probabilities per token requested (top_logprobs, or "
                f"logprobs in completions), more than the server allows: --max-logprobs {cap}, "
                f"a vocabulary of {self.vocab_size}"
            )
        structured_outputs.prepare(params)
