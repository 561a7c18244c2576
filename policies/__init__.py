"""The example policies and connector declarations that ship with wakeful, as `wakeful.policies`.

Only data lives here (`connectors/*.toml`, the README); this file makes the folder a package so that
`importlib.resources.files("wakeful.policies")` finds it both in a checkout and in an installed wheel.
"""
