"""A teacher served over the network: ``meshdistill serve-teacher`` runs a teacher on this host's mesh and answers
top-k requests; ``teacher.source: remote`` (`meshdistill.teachers.kinds.remote`) trains from one.

Modules: `protocol` (the vLLM ``/v1/completions`` subset spoken: requests, answers, limits, identity; no HTTP),
`batching` (concurrent requests gathered into one call of one compiled program), `server` (the Starlette
application on uvicorn), `client` (httpx: identity, top-k with retries and backoff). starlette, uvicorn and httpx
come with the ``serve`` extra; importing this package needs none of them.
"""
