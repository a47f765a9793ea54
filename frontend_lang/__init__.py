"""The Arbor DSL for multi-call LLM programs: gen, select, fork/join, roles and backends.

import frontend_lang as fl

@fl.function
def qa(s, question):
    s += fl.user(question)
    s += fl.assistant(fl.gen("answer", max_tokens=64))

state = qa.run(question="...", backend=fl.Engine(model_path))
state["answer"]

``fl.OpenAI`` loads on first use: the ``openai`` package takes longer to import than the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from frontend_lang.backends import Backend, BackendError, Engine, RuntimeEndpoint
from frontend_lang.chat import CHATML, ChatTemplate, ChatTemplateError
from frontend_lang.errors import ProgramError
from frontend_lang.fork import ForkGroup
from frontend_lang.ir import assistant, gen, select, system, user
from frontend_lang.program import Function, function, get_default_backend, set_default_backend
from frontend_lang.state import ProgramState
from lazy_exports import lazy_exports
from runtime.dsl_api import (
    CHOICES_METHODS,
    GREEDY_TOKEN,
    TOKEN_LENGTH_NORMALIZED,
    UNCONDITIONAL_LIKELIHOOD_NORMALIZED,
)

if TYPE_CHECKING:
    from frontend_lang.backends.openai import OpenAI

__all__, __getattr__ = lazy_exports(__name__)
