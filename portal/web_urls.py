"""The web shell's pages (mounted at the site root)."""

from django.urls import path

from portal.views import accounts, dashboard, secrets, team, tokens

app_name = "portal"
urlpatterns = [
    # signing in and out, password reset
    path("login/", accounts.LoginView.as_view(), name="login"),
    path("logout/", accounts.LogoutView.as_view(), name="logout"),
    path("password-reset/", accounts.PasswordResetView.as_view(), name="password-reset"),
    path("password-reset/sent/", accounts.PasswordResetDoneView.as_view(), name="password-reset-done"),
    path(
        "password-reset/<uidb64>/<token>/",
        accounts.PasswordResetConfirmView.as_view(),
        name="password-reset-confirm",
    ),
    path(
        "password-reset/complete/",
        accounts.PasswordResetCompleteView.as_view(),
        name="password-reset-complete",
    ),
    path("invitations/<str:token>/", accounts.InvitationAcceptView.as_view(), name="invitation-accept"),
    path("account/", accounts.ProfileView.as_view(), name="profile"),
    path("tenant/switch/", accounts.TenantSwitchView.as_view(), name="tenant-switch"),
    # dashboard and its panels
    path("", dashboard.DashboardView.as_view(), name="dashboard"),
    path("panels/getting-started/", dashboard.GettingStartedPanel.as_view(), name="panel-getting-started"),
    path("panels/team/", dashboard.TeamPanel.as_view(), name="panel-team"),
    path("panels/activity/", dashboard.ActivityPanel.as_view(), name="panel-activity"),
    # team
    path("team/", team.TeamView.as_view(), name="team"),
    path("team/invitations/", team.InviteView.as_view(), name="invitation-create"),
    path("team/invitations/<int:pk>/revoke/", team.InvitationRevokeView.as_view(), name="invitation-revoke"),
    path("team/invitations/<int:pk>/resend/", team.InvitationResendView.as_view(), name="invitation-resend"),
    path("team/members/<int:pk>/role/", team.MemberRoleView.as_view(), name="member-role"),
    path("team/members/<int:pk>/remove/", team.MemberRemoveView.as_view(), name="member-remove"),
    # secrets
    path("secrets/", secrets.SecretsView.as_view(), name="secrets"),
    path("secrets/<int:pk>/delete/", secrets.SecretDeleteView.as_view(), name="secret-delete"),
    # API tokens
    path("tokens/", tokens.TokensView.as_view(), name="tokens"),
    path("tokens/new/", tokens.TokenCreateView.as_view(), name="token-create"),
    path("tokens/<int:pk>/revoke/", tokens.TokenRevokeView.as_view(), name="token-revoke"),
]
