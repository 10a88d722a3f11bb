"""The API of getting into workloads: ``access`` of a workload's detail and ``/api/v1/ssh-keys/``.

Registered on portal's shared router by ``scheduling.api`` (which portal autodiscovers).
"""

from __future__ import annotations

from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from portal.api.viewsets import PersonScopedViewSet
from scheduling.models import SshKey
from scheduling.services.ssh_keys import ssh_key_create, ssh_key_delete


class SshAccessSerializer(serializers.Serializer):
    host = serializers.CharField(help_text="The node's address (its agent's advertise_address).")
    port = serializers.IntegerField(help_text="The node agent's SSH endpoint.")
    user = serializers.CharField(help_text="The workload's id.")
    command = serializers.CharField(help_text="What to paste into a terminal.")
    known_hosts = serializers.CharField(help_text="The endpoint's host key as a known_hosts line.")


class AccessPortSerializer(serializers.Serializer):
    port = serializers.IntegerField()
    protocol = serializers.ChoiceField(choices=["http", "tcp"])
    host_port = serializers.IntegerField(allow_null=True, help_text="Null unless published and running.")
    host = serializers.CharField(allow_null=True, help_text="TCP ports: the node's address.")
    url = serializers.CharField(
        allow_null=True, help_text="HTTP ports of a running instance: the portal's proxy."
    )
    note = serializers.CharField(
        allow_blank=True, help_text="Why there is no url or address, or how to use it."
    )


class AccessShareLinkSerializer(serializers.Serializer):
    created_at = serializers.DateTimeField()


class AccessSerializer(serializers.Serializer):
    """How to get into a workload now. Each way in is null while it does not work, with a reason."""

    ssh = SshAccessSerializer(allow_null=True)
    ssh_unavailable_reason = serializers.CharField(allow_blank=True)
    ports = AccessPortSerializer(many=True)
    share_link = AccessShareLinkSerializer(allow_null=True)


class SshKeySerializer(serializers.ModelSerializer):
    public_key = serializers.CharField(
        max_length=16_000, trim_whitespace=False, help_text="'type base64 [comment]'"
    )
    name = serializers.CharField(max_length=100, trim_whitespace=False)

    class Meta:
        model = SshKey
        fields = ["id", "name", "public_key", "fingerprint", "created"]
        read_only_fields = ["id", "fingerprint", "created"]


class SshKeyViewSet(
    PersonScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin
):
    """Your saved SSH public keys (a token's: its creator's). Each opens the running instances of
    every team where your role may operate workloads (owner, admin, member); deleting one shuts
    that door from the next login on."""

    queryset = SshKey.objects.all()
    serializer_class = SshKeySerializer

    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = ssh_key_create(user=self.actor.user, actor=self.actor, **serializer.validated_data)
        return Response(self.get_serializer(key).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        ssh_key_delete(key=instance, actor=self.actor)
