"""Tools for agent loops: a registry (`get_tool`, `build_tools`) and the built-ins `calculator` and `python`."""

from agents.tools.base import TOOLS, Tool, ToolUnavailable, build_tools, call_tool, get_tool, register_tool
from agents.tools.calculator import Calculator
from agents.tools.python_sandbox import PythonTool, SandboxLimits, SandboxResult, SandboxUnavailable, run_python

__all__ = ["TOOLS", "Tool", "ToolUnavailable", "build_tools", "call_tool", "get_tool", "register_tool", "Calculator",
           "PythonTool", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]
