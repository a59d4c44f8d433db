"""The OpenAPI document (``GET /openapi.json``) with every route's request body in it.

The generation and internal routes read their bodies themselves (the size bound first, then
pydantic off the event loop), so FastAPI cannot see their models; each route records its
model here and the document is built with them, plus the OpenAI error body every failure
answers with. Clients and schema-driven fuzzers (schemathesis: ``tests/e2e/test_fuzz.py``)
read this document, so a model that changes changes the document with it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(BaseModel):
    """What every 4xx and 5xx answer carries (``xlserve.openai.errors.error_body``)."""
    error: ErrorDetail


def document_body(app: FastAPI, path: str, model: type[BaseModel]) -> None:
    """Record that ``POST path`` takes a JSON body of ``model``."""
    if not hasattr(app.state, "request_bodies"):
        app.state.request_bodies = {}
    app.state.request_bodies[path] = model


def openapi_document(app: FastAPI) -> dict:
    """The document, built once: FastAPI's routes, the recorded bodies and the error body."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        bodies: dict[str, type[BaseModel]] = getattr(app.state, "request_bodies", {})
        models = [(m, "validation") for m in {*bodies.values(), ErrorBody}]
        refs, defs = models_json_schema(models, ref_template=REF_TEMPLATE)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        error = {"description": "An OpenAI error body",
                 "content": {"application/json": {"schema": refs[(ErrorBody, "validation")]}}}
        for path, methods in doc["paths"].items():
            for method, operation in methods.items():
                operation["responses"].pop("422", None)  # FastAPI's own; our validation errors are 400s
                operation["responses"]["default"] = error
                if method == "post" and path in bodies:
                    schema = refs[(bodies[path], "validation")]
                    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        app.openapi_schema = doc
    return app.openapi_schema
