"""The guest image recipe (`guest/`) that ships with wakeful, as `wakeful.images`.

Only data lives here; this file makes the folder a package so that `importlib.resources.files("wakeful.images")`
finds the recipe both in a checkout and in an installed wheel (`wakeful.vm.image.DEFAULT_RECIPE`).
"""
