"""gpupool-agent: the program that runs on every GPU server.

It imports no Django and no gpupool app; it speaks only HTTP (``nodes/PROTOCOL.md``) to the portal.
"""

__version__ = "0.1.0"
