"""te_client's connection and session in one namespace (connection.py, session.py),
and the te.v1 modules (for code that builds raw requests: client.service_pb2)."""
from te_client import errors, recipe as recipe_lib  # noqa: F401 (deploy/container/container_check.py reads them here)
from te_client._pb import layers_pb2, recipe_pb2, service_pb2, service_pb2_grpc, tensor_pb2
from te_client.connection import Client, Options, connect
from te_client.session import AFFINITY_HEADER, ResidentTensor, Session, current_session

__all__ = ["Client", "Options", "connect", "Session", "ResidentTensor", "current_session", "AFFINITY_HEADER",
           "layers_pb2", "recipe_pb2", "service_pb2", "service_pb2_grpc", "tensor_pb2"]
