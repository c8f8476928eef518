"""MCP (the Model Context Protocol, official ``mcp`` SDK): torpor's tools for agents.

``tools.py``  the tools, written once over a :class:`~torpor.server.mcp.tools.ToolContext`
``http.py``   ``/mcp`` on the server (streamable HTTP; the bearer token's tenant)
``sdk.py``    the sandbox tools over the SDK, for ``torpor mcp`` on stdio
"""
