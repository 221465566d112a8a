"""The core's services: what every layer above the contract asks, and no backend imports.

:mod:`.registry` loads the installed backends and answers which devices they
report; :mod:`.host_ledger` records what each live edge session on this host
holds; :mod:`.source_tree` reads an installed package's Python source with
``ast``, never importing it. The package re-exports nothing: import the module.
"""
