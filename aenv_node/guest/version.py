"""The E2B envd version whose behaviour this envd offers (the node reports it as ``envdVersion``; the SDKs
gate features on it)."""

__envd_version__ = "0.6.4"
