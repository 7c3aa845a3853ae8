"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

``params`` (the user's StructuredOutputsParams) imports nothing heavy; ``grammar`` compiles
them with llguidance and holds each request's grammar state (see its docstring for why
llguidance).
"""

from mlxserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
