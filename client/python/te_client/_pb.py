"""The generated te.v1 modules, loaded once (_stubs.py says from where).

Every te_client module that builds or reads requests imports them from here,
so none needs another's namespace for them (no import cycles through
re-exported protos)."""
from te_client import _stubs

tensor_pb2, recipe_pb2, layers_pb2, service_pb2, service_pb2_grpc = _stubs.load()

__all__ = ["tensor_pb2", "recipe_pb2", "layers_pb2", "service_pb2", "service_pb2_grpc"]
