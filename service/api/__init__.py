"""The HTTP API (docs/API.md, ``/v1``): ``create_app(settings)``; see service/api/app.py."""

from service.api.app import create_app

__all__ = ["create_app"]
