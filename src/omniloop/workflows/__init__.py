"""ComfyUI workflows on omniloop: the compiler from workflow JSON (API or UI format) to
``OmniRequest``s, its coverage report, and the model folder names resolve in.

``compile_workflow(json, ModelFolder.load(dir))`` -> ``CompiledWorkflow`` (its
``generations``: a request and the output nodes it feeds), or a ``WorkflowError`` in
ComfyUI's ``node_errors`` shape."""

from omniloop.workflows.compiler import CompiledWorkflow, Generation, compile_workflow
from omniloop.workflows.errors import NodeProblem, WorkflowError
from omniloop.workflows.evaluate import Deviation
from omniloop.workflows.graph import load_workflow
from omniloop.workflows.model_folder import ModelFolder, ServedCheckpoint

__all__ = ["CompiledWorkflow", "Deviation", "Generation", "ModelFolder", "NodeProblem", "ServedCheckpoint",
           "WorkflowError", "compile_workflow", "load_workflow"]
