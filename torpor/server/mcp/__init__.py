"""MCP (the Model Context Protocol, official ``mcp`` SDK): torpor's tools for agents.

``tools.py``  the tools, written once over a :class:`~torpor.server.mcp.tools.ToolContext`
``endpoint.py`` what both endpoints share: the tenants' memories, authenticate-then-MCP
``http.py``   ``/mcp`` on the server (streamable HTTP; the bearer token's tenant)
``relay.py``  ``localhost:7777`` inside a sandbox (the sandbox's tenant and memory scope)
``sdk.py``    the sandbox tools over the SDK, for ``torpor mcp`` on stdio
"""
