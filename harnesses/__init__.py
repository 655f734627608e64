"""vf-sandbox harnesses: who runs an agent, provisioned into a runtime.

The middle layer; its harnesses (null, bash, installed agents) arrive with their own issue.
"""
