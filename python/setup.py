"""Builds the packd package: the client's sources, and the gRPC stubs of packd.v1 generated from
proto/ (beside this folder, or PACKD_PROTO_DIR) with protoc and grpc_python_plugin."""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = "packd/v1/pack_service.proto"


def _tool(name, env):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise SystemExit(f"packd: {name} is needed to generate the gRPC stubs (Debian: "
                         f"apt-get install protobuf-compiler protobuf-compiler-grpc), or set {env}")
    return path


class BuildWithStubs(build_py):
    """build_py, then protoc writes packd/v1/pack_service_pb2{,_grpc}.py into the build."""

    def run(self):
        super().run()
        proto_dir = os.environ.get("PACKD_PROTO_DIR") or os.path.join(HERE, "..", "proto")
        if not os.path.exists(os.path.join(proto_dir, PROTO)):
            raise SystemExit(f"packd: {PROTO} not found under {proto_dir} (set PACKD_PROTO_DIR)")
        out = os.path.abspath(self.build_lib)
        os.makedirs(os.path.join(out, "packd", "v1"), exist_ok=True)
        subprocess.run([_tool("protoc", "PROTOC"), f"--proto_path={proto_dir}",
                        f"--python_out={out}", f"--grpc_out={out}",
                        "--plugin=protoc-gen-grpc=" + _tool("grpc_python_plugin",
                                                            "GRPC_PYTHON_PLUGIN"),
                        os.path.join(proto_dir, PROTO)], check=True)
        open(os.path.join(out, "packd", "v1", "__init__.py"), "a").close()


setup(cmdclass={"build_py": BuildWithStubs})
