"""DeviceMesh dims that need process groups of their own (fully_shard's dp_mesh_dims).

Flattening several dims of a mesh into one creates that dim's process group (a collective
over the mesh's ranks the first time; DeviceMesh keeps it by name after that), so it lives
here with the other calls that talk to torch.distributed.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


def flatten(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]` as one dim named "_".join(names) (FSDP2's name for it), or the named
    dim itself when there is one."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of `meshes` in order (sub-meshes of one root mesh);
    no new group: each dim keeps its own."""
    if len(meshes) == 1:
        return meshes[0]
    return DeviceMesh._concatenate(meshes)
