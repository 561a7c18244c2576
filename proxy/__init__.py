"""The egress proxy: TLS interception, a policy decision per request, credential injection. Not built yet."""

__all__: list[str] = []
