"""The staff fleet pages: overview (counts, heat map, alerts, node table) and node detail with actions.

Importing this package registers the sidebar entry; ``NodesConfig.ready()`` imports it.
"""

from portal.dashboard import register_nav

register_nav("fleet", "Fleet", "nodes:fleet", order=20, icon="server", staff_only=True)
register_nav("rollouts", "Rollouts", "nodes:rollouts", order=23, icon="layers", staff_only=True)
