"""The OpenAI-compatible API, sans-IO: request types (types.py), parsing and validation of the
two endpoints (parse.py, fields.py), and the response shapes (responses.py). The router's HTTP
front (pddnet/roles/http_api.py) serves it."""
