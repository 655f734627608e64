"""vf-sandbox placement: judges and agents placed into rollout or clean-room sandboxes.

The top layer. For now it holds the ``vf-sandbox`` command line; agent and judge
placement arrives with its own issue.
"""
