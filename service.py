"""`bentoml serve` entry point (bentofile.yaml: service "service:Realizar"). The service itself
lives in realizar_backend/serving/service.py so an installed package serves without a checkout."""

from realizar_backend.serving.service import Realizar

__all__ = ["Realizar"]
